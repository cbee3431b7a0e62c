"""The public client: ``Client`` (sync) and ``AsyncClient``.

Example::

    from client import Client, SamplingParams

    with Client(memory="127.0.0.1:50051", workers=["127.0.0.1:50052"]) as llm:
        out = llm.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                           SamplingParams(temperature=0, max_tokens=32))
        print(out[0].outputs[0].text)

A background thread runs the :class:`~client.engine.core.Engine`: requests submitted
from any thread join the running batch at the next step (continuous batching).
Service errors surface as :mod:`client.errors` exceptions.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator

from client.engine.core import Engine
from client.engine.failover import DEFAULT_STEP_TIMEOUT
from client.engine.recovery import DEFAULT_TIMEOUT as DEFAULT_RECOVERY_TIMEOUT
from client.engine.scheduler import SchedulerConfig
from client.engine.stats import EngineLimits, EngineStats, StepLog
from client.engine.transfers import connect_peers
from client.params import SamplingParams
from client.request import Request
from client.request_output import CompletionOutput, Prompt, RequestOutput, build_output
from client.services import MemoryClient, WorkerClient
from client.tokenizer import encode_prompt, tokenizer_source
from pagedkv.config import DEFAULT_MEMORY, DEFAULT_WORKER
from pagedkv.model.tokenizer import load_tokenizer
from pagedkv.runtime.cache_salt import load_secret, namespace, salted
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.tls import TlsFiles

log = get_logger("client")


class RequestHandle:
    """A submitted request: iterate for streaming outputs, or wait with :meth:`result`.

    With a ``listener``, each output goes to ``listener(output, error)`` on the engine thread
    instead of the handle's queue (iteration is then not available; :meth:`result` is).
    """

    def __init__(self, client: Client, request: Request, listener=None):
        self.client = client
        self._listener = listener
        self.request = request
        self.request_id = request.request_id
        self._queue: queue.Queue[RequestOutput | None] = queue.Queue()
        self._done = threading.Event()
        self.final: RequestOutput | None = None
        self.error: Exception | None = None

    def _publish(self, out: RequestOutput | None, error: Exception | None = None) -> None:
        if error is not None:
            self.error = error
        if out is not None and out.finished or error is not None:
            self.final = out
            self._done.set()
        if self._listener is not None:
            self._listener(out, error)
            return
        self._queue.put(out)
        if self._done.is_set():
            self._queue.put(None)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The finished output. Raises the request's error, or TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.final

    def _next(self) -> RequestOutput | None:
        """The next output (blocking); None after the last one. Raises the request's error at the end."""
        out = self._queue.get()
        if out is None and self.error is not None:
            raise self.error
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            while (out := self._next()) is not None:
                yield out
        finally:
            if not self._done.is_set():
                self.cancel()

    def cancel(self) -> None:
        """Abort the request: its blocks are freed at the start of the next step."""
        self.client._engine.abort(self.request_id)


class Client:
    """Generation through a pagedkv memory service and workers (synchronous API).

    Args:
        memory: memory service address.
        workers: worker addresses; each request is pinned to one (least loaded first).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (chunked prefill).
        lease_ttl: lease TTL in seconds (default: the memory service's).
        max_model_len: longest sequence (prompt + output), tokens; default: the model's context
            capped by the pool (vLLM's ``max_model_len``).
        recovery_timeout: when the lease is lost (the memory service restarted, or the lease
            expired), the engine waits at most this many seconds for the services, then carries
            on with a new lease and its running requests recomputed, or fails every request if
            the services are not back (client.engine.recovery; ``engine.lease_recoveries`` counts them);
            with every worker down, it waits as long for one to come back, then fails the requests
            it holds and keeps its lease (client.engine.failover). Default 60.
        step_timeout: seconds a worker's Step may take before the worker counts as hung: its
            sequences go on on another worker from their KV (client.engine.failover). Default 600.
        tls: mutual TLS files (:class:`pagedkv.runtime.tls.TlsFiles`) for both services; None: plaintext.
        preemption_mode: how a running request is preempted when the pool runs out: "recompute"
            (free its blocks, compute its tokens again later) or "swap" (move its KV to the
            memory service's host tier and back; needs a memory service started with
            ``--host-cache-memory``, else it recomputes). See client.engine.swap.
        peers: memory-service addresses of other nodes whose cached prefixes this node may read
            instead of computing them (client.engine.transfers; every memory service started with the same
            ``--transfer-key-file``, workers with ``--node-transfers``).
        worker_roles: each worker's role, "prefill", "decode" or "both" (default all "both"): a
            request prefills on a prefill worker and is handed to a decode worker with no copy
            (both map the pool; client.engine.scheduler.Scheduler.hand_off).
        cache_namespace: whose prefix-cache entries this client's requests share. None (the
            default): this user's, from a secret in ``$PAGEDKV_HOME/cache-salt-secret`` (made on
            first use, mode 0600): other users' processes can neither hit nor confirm its prompts
            (pagedkv.runtime.cache_salt). A string: that namespace, shared with whoever uses it
            (several users, or fronts, that share a cache on purpose). "": none, every process of
            the machine shares.
        scheduling_policy: the order of the waiting queue (vLLM's ``--scheduling-policy``): "fcfs"
            (the default) or "priority" (by each request's ``priority``, lower first; preemption takes
            the least urgent, latest request first). See client.engine.scheduler.
        admin_token_file: the memory service's admin token file (``--admin-token-file``), read each
            time the engine creates its lease: a lease created with the token is exempt from the
            per-lease block quota (``--max-blocks-per-lease``, half the pool by default) and the limit
            of leases per peer, so this client may schedule the whole pool (``pagedkv serve`` passes
            it). None, an unreadable file or another service's token: a plain lease, under the quota.

    Raises:
        ValueError: no worker address, an unknown ``preemption_mode`` or ``scheduling_policy``, or a
            timeout <= 0.
        ValueError: also when the user's secret file may be read by other users.
        client.errors.ServiceError: a service refused the connection-time calls.
        FileNotFoundError: the model's tokenizer is not on this host (nor, for a Hugging Face repo
            id, in its Hugging Face cache at the worker's revision, with downloads off).
    """

    def __init__(self, memory: str = DEFAULT_MEMORY, workers: Iterable[str] = (DEFAULT_WORKER,), *,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, lease_ttl: float | None = None,
                 max_model_len: int | None = None, recovery_timeout: float = DEFAULT_RECOVERY_TIMEOUT,
                 tls: TlsFiles | None = None, preemption_mode: str = "recompute", peers: Iterable[str] = (),
                 worker_roles: list[str] | None = None, step_timeout: float = DEFAULT_STEP_TIMEOUT,
                 cache_namespace: str | None = None, admin_token_file: str | None = None,
                 scheduling_policy: str = "fcfs"):
        #: The namespace every request's cache salt starts with ("" none).
        self.cache_namespace = namespace(load_secret(), "user") if cache_namespace is None else cache_namespace
        workers = list(workers)
        if not workers:
            raise ValueError("give at least one worker address")
        config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, preemption_mode=preemption_mode,
                                 policy=scheduling_policy)
        self.memory = MemoryClient(memory, tls=tls, lease_admin_token_file=admin_token_file)
        if not step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {step_timeout}")
        self.workers = [WorkerClient(w, timeout=step_timeout, tls=tls) for w in workers]
        info = self.workers[0].model_info()
        # The worker's files when this host has them, else the same model and revision from this
        # host's Hugging Face cache (client.tokenizer.tokenizer_source).
        self.tokenizer = load_tokenizer(tokenizer_source(info))
        self._engine = Engine(self.memory, self.workers, self.tokenizer,
                              config=config, lease_ttl=lease_ttl,
                              max_model_len=max_model_len, recovery_timeout=recovery_timeout,
                              peers=connect_peers(list(peers), tls, lease_ttl), worker_roles=worker_roles)
        self._handles: dict[str, RequestHandle] = {}
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pagedkv-engine", daemon=True)
        self._thread.start()

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def lease_id(self) -> str:
        return self._engine.lease.lease_id

    # ---------------------------------------------------------------- submit
    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               cache_salt: str | None = None, request_id: str | None = None, listener=None,
               priority: int = 0) -> RequestHandle:
        """Queue one prompt (a string, chat messages or token ids); returns its handle at once.

        ``cache_salt`` isolates the request's prefix-cache entries: only requests with
        the same salt share cached blocks (vLLM's cache_salt), inside the client's
        ``cache_namespace``. ``request_id`` names it in
        step traces (default ``req-N``); ``listener`` see :class:`RequestHandle`. ``priority``: its
        place under the "priority" scheduling policy (lower runs first; vLLM's).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt longer
                than the model's context, or a priority other than 0 under the "fcfs" policy.
        """
        params = sampling_params or SamplingParams()
        req = Request(prompt, encode_prompt(self.tokenizer, prompt), params,
                      cache_salt=salted(self.cache_namespace, cache_salt), priority=priority)
        if request_id is not None:
            req.request_id = request_id
        handle = RequestHandle(self, req, listener)
        self._handles[req.request_id] = handle  # before add: the engine thread may publish at once
        try:
            self._engine.add(req)
        except BaseException:
            del self._handles[req.request_id]
            raise
        with self._wake:
            self._wake.notify()
        return handle

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, progress: bool = False, cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); one output per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        handles = [self.submit(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, params)]
        if progress:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("generating", total=len(handles))
                while not all(h._done.is_set() for h in handles):
                    time.sleep(0.1)
                    bar.update(task, completed=sum(h._done.is_set() for h in handles))
        return [h.result() for h in handles]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every step that changed it.

        Closing the iterator early cancels the request and frees its blocks.
        """
        yield from self.submit(prompt, sampling_params)

    def abort(self, request_id: str) -> None:
        """Abort a request by id (thread-safe): its blocks are freed at the engine's next step."""
        self._engine.abort(request_id)

    def stats(self):
        """The memory service's GetStats."""
        return self.memory.stats()

    # ----------------------------------------------------- the front's seam (client.backend)
    @property
    def limits(self) -> EngineLimits:
        """The model served and the limits a request must fit."""
        return self._engine.limits

    def engine_stats(self) -> EngineStats:
        """The engine's stats after its last step (client.engine.stats)."""
        return self._engine.stats()

    def node_stats(self) -> dict[str, EngineStats]:
        """:meth:`engine_stats` by node name: this client's memory-service address."""
        return {self.memory.address: self._engine.stats()}

    def drain(self, address: str, timeout: float = 30.0) -> dict:
        """Drain the worker at ``address``: between two steps, its requests move to the other workers
        (their KV stays in the pool: nothing is copied or computed again) and it gets no more work,
        so it can stop. The drain ends with :meth:`undrain` or when that worker restarts.

        Returns:
            ``{"worker": address, "state": "draining", "moved_sequences": N}`` ("down" if it had failed).

        Raises:
            KeyError: ``address`` is not one of this client's workers.
            TimeoutError: the engine did not reach a step boundary within ``timeout`` seconds.
        """
        return self._worker_request(address, True, timeout)

    def undrain(self, address: str, timeout: float = 30.0) -> dict:
        """End a drain (:meth:`drain`): the worker takes work again. Returns as :meth:`drain`."""
        return self._worker_request(address, False, timeout)

    def _worker_request(self, address: str, drain: bool, timeout: float) -> dict:
        reply = self._engine.failover.request(address, drain)
        with self._wake:
            self._wake.notify()
        return reply.result(timeout)

    def step_logs(self, since: int = 0) -> dict[str, StepLog]:
        """The engine's step trace from step ``since`` on, by node name (:meth:`node_stats`)."""
        return {self.memory.address: self._engine.step_log(since)}

    # ----------------------------------------------------------------- loop
    def _loop(self) -> None:
        engine = self._engine
        while not self._closed:
            if not engine.has_work():
                with self._wake:
                    self._wake.wait(0.05)
                continue
            try:
                before = engine.step_count
                updated = engine.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep the client usable
                log.error("step_failed", error=str(e))
                self._fail_all(e)
                continue
            for req in updated:
                handle = self._handles.get(req.request_id)
                if handle is None:
                    continue
                out = build_output(req, self.tokenizer)
                handle._publish(out, req.error)
                if out.finished or req.error is not None:
                    self._handles.pop(req.request_id, None)
            if engine.step_count == before and not updated:
                time.sleep(0.01)

    def _fail_all(self, error: Exception) -> None:
        for r in self._engine.fail_all(error):
            handle = self._handles.pop(r.request_id, None)
            if handle is not None:
                handle._publish(None, error)

    def close(self) -> None:
        """Stop the engine thread and release the lease (every sequence is freed)."""
        if self._closed:
            return
        self._closed = True
        self._engine.recovery.cancel()  # a recovery waiting for the services gives up
        self._thread.join(timeout=30)
        self._engine.close()
        self.memory.close()
        for w in self.workers:
            w.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of :class:`Client`: same arguments, awaitable methods.

    Create with ``client = await AsyncClient.connect(...)``.
    """

    def __init__(self, client: Client):
        self._client = client

    @classmethod
    async def connect(cls, *args, **kwargs) -> AsyncClient:
        return cls(await asyncio.to_thread(Client, *args, **kwargs))

    async def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        return await asyncio.to_thread(self._client.generate, prompts, sampling_params)

    async def stream(self, prompt: Prompt,
                     sampling_params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        handle = self._client.submit(prompt, sampling_params)
        try:
            while (out := await asyncio.to_thread(handle._next)) is not None:
                yield out
        finally:
            if not handle._done.is_set():
                handle.cancel()

    async def stats(self):
        return await asyncio.to_thread(self._client.stats)

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = ["AsyncClient", "Client", "CompletionOutput", "Prompt", "RequestHandle", "RequestOutput", "build_output"]
