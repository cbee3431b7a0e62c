"""The client's engine: continuous batching over the memory service and the workers.

One :meth:`Engine.step` (vLLM's scheduler + engine step, split across services)::

    1. free      sequences aborted since the last step            (1 FreeSequences)
    2. fork      parallel-sampling prompts and beams that branch   (1 ForkSequences)
    3. schedule  running requests first (decode tokens, then the rest of chunked
                 prefills), then admit waiting ones, under a token budget
    4. append    slots for every scheduled, allocated sequence    (1 AppendSlots)
                 -> OUT_OF_BLOCKS: preempt the most recently admitted request by
                    recompute (free its blocks, requeue it at the front) and retry
    5. allocate  sequences for newly admitted requests            (1 AllocateSequences)
                 -> OUT_OF_BLOCKS: admit fewer (they wait)
    6. Step      one call per worker: copy-on-write pairs, tokens, positions,
                 block tables, sampling; the worker samples
    7. update    append sampled tokens, check stops, advance beams;
                 free finished sequences                          (1 FreeSequences)
                 report blocks filled this step (prefix cache)    (1 CommitComputedTokens)

so a step makes a constant number of memory-service calls (plus one per
preemption) and one Step call per worker. Requests join between steps and
leave as soon as they finish. Sampling is reproducible without worker state:
the draw for output position t depends on (seed + sample index, t), so a
preempted request resumes on the same draws.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from client.beam import BeamState
from client.errors import OutOfBlocks, ServiceError
from client.request import Request, Seq, Status
from client.services import Lease, MemoryClient, WorkerClient
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.errors import OUT_OF_BLOCKS
from pagedkv.logs import get_logger
from pagedkv.memory.v1 import memory_service_pb2 as mpb

log = get_logger("engine")


@dataclass(slots=True)
class EngineConfig:
    """Scheduler limits."""

    #: Most requests running at once.
    max_num_seqs: int = 64
    #: Token budget of one step (chunked prefill splits prompts to fit it).
    max_num_batched_tokens: int = 512
    #: KV reservation policy: "paged" (blocks on demand, the default) or, to compare with
    #: systems that reserve contiguous space per request (the vLLM paper's Orca baselines):
    #: "max" (max_model_len tokens), "pow2" (final length rounded up to a power of two),
    #: "oracle" (the true final length, prompt + max_tokens). Reserving policies allocate
    #: the whole reservation at admission and never append; they take n=1 requests only.
    reservation: str = "paged"
    #: Tokens "max" reserves per request (the paper's Orca-Max: 2048).
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.reservation not in ("paged", "max", "pow2", "oracle"):
            raise ValueError(f"reservation must be paged, max, pow2 or oracle, got {self.reservation!r}")

    def reserve(self, prompt_len: int, max_tokens: int) -> int | None:
        """Tokens to reserve at admission for a request (None: paged, allocate on demand)."""
        final = prompt_len + max_tokens
        if self.reservation == "paged":
            return None
        if self.reservation == "max":
            return max(self.max_model_len, final)
        if self.reservation == "pow2":
            return 1 << (final - 1).bit_length()
        return final


@dataclass(slots=True)
class StepTrace:
    """What one step ran (for tests and the demo)."""

    step: int
    #: Request ids with a sequence in the batch.
    request_ids: list[str]
    #: Tokens computed (prefill + decode).
    num_tokens: int
    #: Request ids that finished in this step.
    finished: list[str]
    #: Requests preempted in this step.
    preempted: list[str] = field(default_factory=list)
    #: Seconds in the workers' forward (max over workers) and in the whole step.
    model_seconds: float = 0.0
    step_seconds: float = 0.0


class Engine:
    """Schedules requests over one memory service and one or more workers.

    Not thread-safe except :meth:`add` and :meth:`abort`; one thread calls :meth:`step`.
    """

    def __init__(self, memory: MemoryClient, workers: list[WorkerClient], tokenizer, *,
                 config: EngineConfig | None = None, lease_ttl: float | None = None):
        self.memory = memory
        self.workers = workers
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        pool = memory.pool()
        self.generation = pool.generation
        self.block_size = pool.layout.block_size
        self.num_blocks = pool.layout.num_blocks
        info = workers[0].model_info()
        self.model_info = info
        #: Prefix-cache identity of this model's KV.
        self.model_id = f"{info.model_name}:{info.model_source}"
        self.prefix_caching = memory.stats().prefix_caching
        self.eos_ids = set(info.eos_token_ids)
        self.max_context = min(info.max_context or 1 << 30, self.num_blocks * self.block_size)
        self.lease = Lease(memory, lease_ttl)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._lock = threading.Lock()
        self._aborts: set[str] = set()
        self._pending_forks: list[tuple[Request, Seq, int]] = []  # (request, parent, copies)
        self._pending_beams: list[tuple[Request, list[tuple[Seq, int, float]]]] = []
        self.step_count = 0
        self.preemptions = 0
        self.traces: collections.deque[StepTrace] = collections.deque(maxlen=100_000)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(workers)), thread_name_prefix="pagedkv-step")
        self.on_update = None  # callback(request) after each step that changed it

    # ----------------------------------------------------------------- intake
    def add(self, request: Request) -> None:
        """Queue a request (thread-safe). Raises ValueError when it can never fit."""
        if self.config.reservation != "paged" and (request.params.n > 1 or request.params.use_beam_search):
            raise ValueError(f"the {self.config.reservation!r} reservation policy takes n=1 requests without beam search")
        if len(request.prompt_token_ids) >= self.max_context:
            raise ValueError(f"the prompt has {len(request.prompt_token_ids)} tokens; the model and pool allow "
                             f"{self.max_context - 1} (max context {self.max_context})")
        if request.params.use_beam_search:
            p = request.params
            request.beam = BeamState(p.num_beams, p.length_penalty, p.early_stopping,
                                     min(p.max_tokens, self.max_context - len(request.prompt_token_ids)), self.eos_ids)
        with self._lock:
            self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe): its blocks are freed at the start of the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting or self.running or self._aborts)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.lease.close()

    # ------------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests it updated (finished ones included)."""
        t0 = time.perf_counter()
        lease = self.lease.lease_id
        updated: dict[str, Request] = {}
        self._handle_aborts(updated)
        self._do_forks()
        scheduled, admitted = self._schedule()
        preempted: list[str] = []
        if not scheduled:
            self._fail_unschedulable(updated)
            return list(updated.values())
        copies_by_worker: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        # Appends for sequences with blocks; preempt on OUT_OF_BLOCKS.
        while True:
            reserved = self.config.reservation != "paged"  # slots were reserved at admission
            appends = [] if reserved else [(s.seq_id, n, s.tokens[s.num_computed:s.num_computed + n])
                                           for _, s, n in scheduled if s.seq_id is not None]
            if not appends:
                break
            try:
                resp = self.memory.append(lease, appends)
            except OutOfBlocks as e:
                victim = self._pick_victim(scheduled, admitted)
                if victim is None:  # a lone request that cannot grow: the pool is too small for it
                    victim = scheduled[0][0]
                    self._fail(victim, e, updated)
                else:
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                scheduled = [x for x in scheduled if x[0] is not victim]
                admitted = [r for r in admitted if r is not victim]
                continue
            by_id = {s.seq_id: (r, s) for r, s, _ in scheduled if s.seq_id is not None}
            for u in resp.updates:
                r, s = by_id[u.seq_id]
                s.block_table[u.first_changed:] = list(u.block_ids)
            for c in resp.copies:
                # The copy goes to the worker running the sequence whose table now holds dst.
                owner = next(r for r, s, _ in scheduled if c.dst in s.block_table)
                copies_by_worker[owner.worker].append((c.src, c.dst))
            break
        # Allocations for admitted or recomputed sequences; admit fewer on OUT_OF_BLOCKS.
        scheduled = self._allocate(scheduled, admitted)
        if not scheduled:
            return list(updated.values())
        results, model_seconds = self._run_workers(scheduled, copies_by_worker)
        finished_ids = self._update(scheduled, results, updated)
        trace = StepTrace(self.step_count, list(dict.fromkeys(r.request_id for r, _, _ in scheduled)),
                          sum(n for _, _, n in scheduled), finished_ids, preempted,
                          model_seconds, time.perf_counter() - t0)
        self.traces.append(trace)
        self.step_count += 1
        return list(updated.values())

    # --------------------------------------------------------------- pieces
    def _handle_aborts(self, updated: dict) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            if not aborts:
                return
            victims = [r for r in [*self.running, *self.waiting] if r.request_id in aborts]
            for r in victims:
                if r in self.running:
                    self.running.remove(r)
                else:
                    self.waiting.remove(r)
        to_free = [s.seq_id for r in victims for s in r.seqs if s.seq_id is not None]
        if to_free:
            self.memory.free(self.lease.lease_id, to_free, mpb.FREE_REASON_ABORTED)
        for r in victims:
            for s in r.seqs:
                s.seq_id = None
                if not s.finished:
                    s.finish_reason = "abort"
            if r.beam is not None:
                r.beam.done = True
            r.status = Status.FINISHED
            r.metrics.finished = time.time()
            updated[r.request_id] = r

    def _do_forks(self) -> None:
        """Fork parallel-sampling prompts and branching beams in one call; free dropped beams."""
        lease = self.lease.lease_id
        drop: list[int] = []
        parents: list[tuple[Request, Seq, int | None, float | None, int]] = []
        for req, parent, copies in self._pending_forks:
            parents.extend((req, parent, None, None, i) for i in range(copies))
        self._pending_forks = []
        new_beams: dict[str, list[Seq | None]] = {}
        for req, nxt in self._pending_beams:
            used: set[int] = set()
            beams: list[Seq | None] = []
            for parent, tok, score in nxt:
                if id(parent) not in used:  # the first child continues in the parent's sequence
                    used.add(id(parent))
                    parent.tokens.append(tok)
                    parent.beam_score = score
                    beams.append(parent)
                else:  # every other child forks it
                    parents.append((req, parent, tok, score, len(beams)))
                    beams.append(None)
            drop.extend(s.seq_id for s in req.seqs if id(s) not in used and s.seq_id is not None)
            new_beams[req.request_id] = beams
        pending_beams, self._pending_beams = self._pending_beams, []
        if drop:
            self.memory.free(lease, drop, mpb.FREE_REASON_ABORTED)
        forkable = [x for x in parents if x[1].seq_id is not None]
        children = self.memory.fork(lease, [x[1].seq_id for x in forkable]) if forkable else []
        child_of = {id(x): c for x, c in zip(forkable, children)}
        for x in parents:
            req, parent, tok, score, slot = x
            if tok is None:  # parallel sampling: sample `slot + 1` of the prompt
                seq = Seq(slot + 1, list(parent.tokens), parent.prompt_len)
            else:  # a beam branching from `parent`, whose own next token is already appended
                seq = Seq(0, [*parent.tokens[:-1], tok], parent.prompt_len, beam_score=score)
            c = child_of.get(id(x))
            if c is not None:
                seq.seq_id, seq.block_table, seq.num_computed = c.seq_id, list(c.block_ids), parent.num_computed
            if tok is None:
                req.seqs.append(seq)
            else:
                new_beams[req.request_id][slot] = seq
        for req, _ in pending_beams:
            req.seqs = new_beams[req.request_id]
        for req in {id(r): r for r, *_ in parents}.values():
            for s in req.seqs:
                s.compute_limit = None

    def _schedule(self) -> tuple[list[tuple[Request, Seq, int]], list[Request]]:
        """(request, sequence, tokens to compute) for this step, and the requests admitted in it."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, Seq, int]] = []
        # Decode tokens first (one each), then the rest of chunked prefills.
        for want_decode in (True, False):
            for req in self.running:
                for seq in req.live_seqs():
                    n = seq.pending()
                    if n == 0 or (n == 1) != want_decode or budget == 0:
                        continue
                    n = min(n, budget)
                    scheduled.append((req, seq, n))
                    budget -= n
        admitted: list[Request] = []
        free_blocks = self._estimate_free_blocks(scheduled)
        with self._lock:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                chunks = []
                for seq in req.live_seqs():
                    n = min(seq.pending(), budget - sum(chunks))
                    if n > 0:
                        chunks.append(n)
                reserve = self.config.reserve(len(req.prompt_token_ids), req.params.max_tokens)
                if reserve is not None:
                    chunks = chunks[:1]
                    need = -(-min(reserve, self.max_context) // self.block_size)
                else:
                    need = sum(-(-n // self.block_size) for n in chunks)
                if not chunks or need > free_blocks:
                    break
                self.waiting.popleft()
                free_blocks -= need
                budget -= sum(chunks)
                req.status = Status.RUNNING
                if req.worker is None:
                    load = collections.Counter(r.worker for r in self.running)
                    req.worker = min(range(len(self.workers)), key=lambda w: load[w])
                if req.metrics.first_scheduled is None:
                    req.metrics.first_scheduled = time.time()
                self.running.append(req)
                admitted.append(req)
                it = iter(chunks)
                for seq in req.live_seqs():
                    if seq.pending() > 0:
                        scheduled.append((req, seq, next(it, 0)))
                scheduled = [x for x in scheduled if x[2] > 0]
        return scheduled, admitted

    def _estimate_free_blocks(self, scheduled) -> int:
        """Blocks the pool will have after this step's appends (from the last known stats)."""
        try:
            available = self.memory.stats().available_blocks
        except ServiceError:
            return 0
        grow = 0
        for r, s, n in scheduled:
            if s.seq_id is not None:
                have = len(s.block_table) * self.block_size
                grow += max(0, -(-(s.num_computed + n - have) // self.block_size))
                grow += len(r.seqs) > 1  # a forked sequence may copy its shared last block
        return available - grow

    def _pick_victim(self, scheduled, admitted) -> Request | None:
        """The most recently admitted running request (vLLM's recompute preemption order)."""
        live = [r for r in self.running if any(x[0] is r for x in scheduled)]
        if len(live) <= 1:
            return None
        return live[-1]

    def _preempt(self, req: Request) -> None:
        ids = [s.seq_id for s in req.seqs if s.seq_id is not None]
        if ids:
            self.memory.free(self.lease.lease_id, ids, mpb.FREE_REASON_PREEMPTED)
        for s in req.seqs:
            s.reset()
        self.running.remove(req)
        req.status = Status.WAITING
        req.metrics.preemptions += 1
        self.preemptions += 1
        with self._lock:
            self.waiting.appendleft(req)
        log.info("preempted", request_id=req.request_id, generated=[len(s.generated) for s in req.seqs])

    def _allocate(self, scheduled, admitted):
        """Allocate the sequences without blocks; with prefix caching, skip what is cached."""
        new = [(r, s, n) for r, s, n in scheduled if s.seq_id is None]
        while new:
            requests = []
            for r, s, n in new:
                reserve = self.config.reserve(len(r.prompt_token_ids), r.params.max_tokens)
                if reserve is not None:  # contiguous reservation (baseline policies): no prefix cache
                    requests.append(mpb.SequenceAllocation(num_tokens=min(reserve, self.max_context)))
                    continue
                known = s.tokens if s.compute_limit is None else s.tokens[:s.compute_limit]
                requests.append(mpb.SequenceAllocation(num_tokens=n, token_ids=known, model_id=self.model_id,
                                                       cache_salt=r.cache_salt))
            try:
                tables = self.memory.allocate(self.lease.lease_id, requests)
            except OutOfBlocks:
                last = admitted.pop() if admitted else None
                if last is None:
                    raise
                self.running.remove(last)
                last.status = Status.WAITING
                with self._lock:
                    self.waiting.appendleft(last)
                scheduled = [x for x in scheduled if x[0] is not last]
                new = [x for x in new if x[0] is not last]
                continue
            chunk = {}
            for (_, s, n), t in zip(new, tables):
                s.seq_id, s.block_table = t.seq_id, list(t.block_ids)
                s.num_computed = s.num_committed = t.num_cached_tokens
                chunk[id(s)] = min(n, t.num_tokens - t.num_cached_tokens)
            scheduled = [(r, s, chunk.get(id(s), n)) for r, s, n in scheduled]
            break
        return scheduled

    def _fail_unschedulable(self, updated: dict) -> None:
        """Nothing could run: a waiting request that cannot fit even in an empty pool fails."""
        with self._lock:
            if self.running or not self.waiting:
                return
        try:
            stats = self.memory.stats()
        except ServiceError:
            return
        if stats.used_blocks > 0:
            return  # other clients hold blocks; wait for them
        with self._lock:
            req = self.waiting.popleft()
        need = -(-len(req.seqs[0].tokens) // self.block_size)
        self._fail(req, OutOfBlocks(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request {req.request_id} needs {need} blocks for its first chunk but the pool has {stats.available_blocks}",
            OUT_OF_BLOCKS, {"required": str(need), "available": str(stats.available_blocks)}), updated)

    def _fail(self, req: Request, error: Exception, updated: dict) -> None:
        """End ``req`` with ``error``, freeing whatever it holds."""
        ids = [s.seq_id for s in req.seqs if s.seq_id is not None]
        if ids:
            self.memory.free(self.lease.lease_id, ids, mpb.FREE_REASON_ABORTED)
        for s in req.seqs:
            s.reset()
        if req in self.running:
            self.running.remove(req)
        req.error = error
        req.status = Status.FINISHED
        req.metrics.finished = time.time()
        updated[req.request_id] = req
        log.warning("request_failed", request_id=req.request_id, error=str(error))

    def _run_workers(self, scheduled, copies_by_worker) -> tuple[dict[int, cpb.StepResult], float]:
        by_worker: dict[int, cpb.StepRequest] = {}
        for req, seq, n in scheduled:
            step = by_worker.setdefault(req.worker, cpb.StepRequest(pool_generation=self.generation))
            start = seq.num_computed
            end = start + n
            p = req.params
            sampling = cpb.SamplingParams()
            if p.use_beam_search:
                sampling.num_logprobs = req.beam.top_k
            else:
                if p.temperature > 0:
                    sampling.temperature = p.temperature
                    if p.top_k:
                        sampling.top_k = p.top_k
                    if p.top_p < 1:
                        sampling.top_p = p.top_p
                    if p.seed is not None:
                        sampling.seed = p.seed + seq.index
                if p.logprobs is not None:
                    sampling.num_logprobs = p.logprobs
            skip = end < len(seq.tokens) or (seq.compute_limit is not None and end >= seq.compute_limit)
            step.sequences.append(cpb.StepSequence(
                seq_id=seq.seq_id, token_ids=seq.tokens[start:end], positions=range(start, end),
                block_ids=seq.block_table, sampling=sampling, output_index=len(seq.generated), skip_sampling=skip))
        for w, copies in copies_by_worker.items():
            by_worker[w].copies.extend(cpb.BlockCopy(src=s, dst=d) for s, d in copies)
        futures = {w: self._pool.submit(self.workers[w].step, req) for w, req in by_worker.items()}
        results: dict[int, cpb.StepResult] = {}
        model_seconds = 0.0
        for f in futures.values():
            resp = f.result()
            model_seconds = max(model_seconds, resp.model_seconds)
            for r in resp.results:
                results[r.seq_id] = r
        return results, model_seconds

    def _update(self, scheduled, results, updated: dict) -> list[str]:
        now = time.time()
        to_free: list[int] = []
        finished: list[str] = []
        for req, seq, n in scheduled:
            seq.num_computed += n
            res = results[seq.seq_id]
            updated[req.request_id] = req
            if seq.compute_limit is not None and seq.num_computed >= seq.compute_limit:
                self._pending_forks.append((req, seq, req.params.n - 1))
                continue
            if not res.HasField("token_id"):
                continue
            if req.metrics.first_token is None:
                req.metrics.first_token = now
            if req.beam is not None:
                req.beam.pending[id(seq)] = [(t.token_id, t.logprob) for t in res.top_logprobs]
                continue
            self._append_token(req, seq, res)
            if seq.finished and seq.seq_id is not None:
                to_free.append(seq.seq_id)
                seq.seq_id = None
        for req in {id(r): r for r, _, _ in scheduled}.values():
            beam = req.beam
            if beam is not None and beam.pending and len(beam.pending) == len(req.seqs):
                # Every live beam has its candidates (they may arrive over several steps after a preemption).
                nxt = beam.step(req.seqs, [beam.pending[id(s)] for s in req.seqs])
                beam.pending.clear()
                if nxt:
                    self._pending_beams.append((req, nxt))
                else:
                    to_free.extend(s.seq_id for s in req.seqs if s.seq_id is not None)
                    for s in req.seqs:
                        s.seq_id = None
            if req.finished and req.status != Status.FINISHED:
                req.status = Status.FINISHED
                req.metrics.finished = now
                self.running.remove(req)
                finished.append(req.request_id)
        if to_free:
            self.memory.free(self.lease.lease_id, to_free, mpb.FREE_REASON_FINISHED)
        self._commit(scheduled)
        return finished

    def _commit(self, scheduled) -> None:
        """Report computed tokens of sequences that filled a block this step (prefix caching)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        commits = []
        for _, s, _ in scheduled:
            if s.seq_id is not None and s.num_computed // bs > s.num_committed // bs:
                commits.append((s.seq_id, s.num_computed))
                s.num_committed = s.num_computed
        if commits:
            self.memory.commit(self.lease.lease_id, commits)

    def _append_token(self, req: Request, seq: Seq, res: cpb.StepResult) -> None:
        p = req.params
        tok = res.token_id
        seq.tokens.append(tok)
        if p.logprobs is not None:
            seq.token_logprobs.append(res.logprob)
            seq.top_logprobs.append({t.token_id: t.logprob for t in res.top_logprobs})
        n_gen = len(seq.generated)
        if not p.ignore_eos and tok in self.eos_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif tok in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif p.stop:
            text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                at, s = min(hits)
                seq.finish_reason, seq.stop_reason, seq.final_text = "stop", s, text[:at]
        if seq.finish_reason is None and (n_gen >= p.max_tokens or len(seq.tokens) >= self.max_context):
            seq.finish_reason = "length"
