"""Prometheus metrics of a compute worker (``pagedkv compute --metrics-port``), observed once per step.

Every number comes from what the step measures anyway for its ``StepResponse`` (DESIGN.md: the
worker adds no device synchronization for metrics): the step's wall seconds, the forward's seconds
(CUDA events read after the fence the receipts already wait for; the wall clock on a CPU), the
seconds in paged attention (:class:`compute_service.timing.AttentionClock`, measured on a CPU pool
only: on a GPU the attention histogram gets no sample), the batch and its tokens, and the blocks
the step's grants made it copy. :meth:`WorkerMetrics.observe_step` does a handful of
``Histogram.observe`` / ``Counter.inc`` calls (about a microsecond each), once per step.

| metric | kind | unit |
|---|---|---|
| ``pagedkv:worker_step_seconds`` | histogram | a Step's wall seconds (checks, copies, forward, sampling) |
| ``pagedkv:worker_model_seconds`` | histogram | the forward's seconds (steps with a forward) |
| ``pagedkv:worker_attention_seconds`` | histogram | paged attention's seconds, all layers (CPU pools only) |
| ``pagedkv:worker_batch_size`` | histogram | sequences computed in a step |
| ``pagedkv:worker_step_tokens`` | histogram | tokens computed in a step (prefill + decode) |
| ``pagedkv:worker_copies_total{kind}`` | counter | blocks copied, by ``kind`` (below) |

``kind``: ``offload``, ``reload``, ``transfer``, ``cow`` (the copies of a step's grants), ``disk_write``,
``disk_read`` (CopyDiskBlocks: the copies whose receipt says ``ok``).

A step that fails (an error status) is not observed; one whose sequences were all refused counts
as a step of batch size 0.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

#: Buckets of the seconds histograms: a decode step on a GPU (~1 ms) to a long prefill on a CPU.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
#: Buckets of the batch size (sequences): powers of two up to a step's most (4,096).
BATCH_BUCKETS = tuple(float(2 ** i) for i in range(13))
#: Buckets of the tokens per step (vLLM's ``iteration_tokens_total`` uses powers of two too).
TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(17))
#: The ``kind`` label's values.
COPY_KINDS = ("offload", "reload", "transfer", "cow", "disk_write", "disk_read")


class WorkerMetrics:
    """One worker's step metrics, in a registry of their own (:attr:`registry`).

    Thread-safe (prometheus_client's metrics lock themselves); observed from the compute thread
    (steps) and the disk I/O thread (disk copies).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram("pagedkv:worker_step_seconds", "Seconds of a Step on the worker: grant "
                                      "checks, copies, forward and sampling.", buckets=SECONDS_BUCKETS, registry=r)
        self.model_seconds = Histogram("pagedkv:worker_model_seconds", "Seconds of a step's forward (device events "
                                       "on CUDA, the wall clock on a CPU); steps with a forward.",
                                       buckets=SECONDS_BUCKETS, registry=r)
        self.attention_seconds = Histogram("pagedkv:worker_attention_seconds", "Seconds of a step's forward spent in "
                                           "paged attention, all layers (measured on a CPU pool only).",
                                           buckets=SECONDS_BUCKETS, registry=r)
        self.batch_size = Histogram("pagedkv:worker_batch_size", "Sequences computed in a step.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.step_tokens = Histogram("pagedkv:worker_step_tokens", "Tokens computed in a step (prefill + decode).",
                                     buckets=TOKEN_BUCKETS, registry=r)
        copies = Counter("pagedkv:worker_copies", "Blocks copied, by kind: offload (device to host tier), reload "
                         "(host tier to device), transfer (another node's pool to this one), cow (copy-on-write), "
                         "disk_write / disk_read (the disk tier, proven by a receipt).", labelnames=["kind"],
                         registry=r)
        #: The counter of each kind, made once (``labels()`` looks up a dict under a lock).
        self.copies = {kind: copies.labels(kind=kind) for kind in COPY_KINDS}

    def observe_step(self, *, step_seconds: float, model_seconds: float, attention_seconds: float | None,
                     batch_size: int, num_tokens: int, offloads: int = 0, reloads: int = 0, transfers: int = 0,
                     copy_on_write: int = 0) -> None:
        """Count one step that answered.

        Args:
            step_seconds, model_seconds: as in its StepResponse (``model_seconds`` only when the step
                ran a forward, ``batch_size`` > 0).
            attention_seconds: its StepResponse's, or None where attention is not timed (a GPU).
            batch_size, num_tokens: sequences and tokens computed.
            offloads, reloads, transfers, copy_on_write: blocks the step copied, by kind.
        """
        self.step_seconds.observe(step_seconds)
        self.batch_size.observe(batch_size)
        self.step_tokens.observe(num_tokens)
        if batch_size:
            self.model_seconds.observe(model_seconds)
            if attention_seconds is not None:
                self.attention_seconds.observe(attention_seconds)
        for kind, n in (("offload", offloads), ("reload", reloads), ("transfer", transfers),
                        ("cow", copy_on_write)):
            if n:
                self.copies[kind].inc(n)

    def observe_disk(self, writes: int, reads: int) -> None:
        """Count a CopyDiskBlocks batch's proven copies (receipts with ``ok``)."""
        if writes:
            self.copies["disk_write"].inc(writes)
        if reads:
            self.copies["disk_read"].inc(reads)


def start_metrics_server(metrics: WorkerMetrics, host: str, port: int) -> int:
    """Serve ``metrics`` as Prometheus ``/metrics`` on ``host:port`` (0: a free port) from a daemon
    thread; returns the bound port.

    Raises:
        OSError: the port cannot be bound.
    """
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return server.server_port


__all__ = ["COPY_KINDS", "WorkerMetrics", "start_metrics_server"]
