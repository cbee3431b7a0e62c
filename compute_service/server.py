"""The compute worker's gRPC API (``pagedkv.compute.v1.ComputeService``).

``Step`` runs on the worker's one compute thread (the forward releases the GIL),
so health checks and GetModelInfo answer while a step computes; steps run one at
a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from concurrent.futures import Executor, ThreadPoolExecutor

from compute_service.disk_copier import check_generation
from compute_service.model.fused_decode import cpu_path
from compute_service.model.llama import LlamaForPagedLM
from compute_service.worker import Worker
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.compute.v1 import compute_service_pb2_grpc as pb_grpc
from pagedkv.model.source import ResolvedModel
from pagedkv.runtime.errors import POOL_NOT_MAPPED, FailedPreconditionError
from pagedkv.runtime.service import map_errors
from pagedkv.runtime.tls import require_role

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ComputeService"].full_name


@map_errors
class ComputeServicer(pb_grpc.ComputeServiceServicer):
    """Serves one :class:`Worker` of ``model`` (its name, local files and resolved revision,
    pagedkv.model.source): GetModelInfo reports them, so that a client loads the same tokenizer and
    keys its prefix cache on the revision."""

    def __init__(self, worker: Worker, model: ResolvedModel, device: str, compute: Executor | None = None):
        self.worker = worker
        #: Where steps run (None: asyncio's default executor).
        self.compute = compute
        #: Where disk-tier copies run: a thread of their own, so that a slow disk delays no step.
        self.disk_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-io")
        #: The model as named (--model): "smollm2", a path, or a repo id.
        self.model_source = model.name
        #: The local file or directory loaded (a hub snapshot folder for a repo id).
        self.weights_path = str(model.path)
        #: Commit hash of a hub snapshot, or the local files' fingerprint.
        self.revision = model.revision
        self.device = device
        #: The CPU compute path the model runs on (GetModelInfoResponse.cpu_path; "" on a GPU).
        self.cpu_path = cpu_path(worker.model) if isinstance(worker.model, LlamaForPagedLM) else ""
        #: New at every start of the process (GetModelInfoResponse.instance_id).
        self.instance_id = secrets.token_hex(8)
        if model.name == "smollm2":
            self.model_name = "SmolLM2-135M-Instruct"
        else:  # a snapshot folder is named by its commit: the repo id names the model better
            self.model_name = model.repo_id or worker.config.name

    async def Step(self, request, context):
        require_role(context, {"scheduler"}, "Step")  # under TLS: schedulers (and the admin) only
        return await asyncio.get_running_loop().run_in_executor(self.compute, self.worker.step, request)

    async def CopyDiskBlocks(self, request, context):
        require_role(context, {"scheduler"}, "CopyDiskBlocks")  # under TLS: schedulers (and the admin) only
        check_generation(self.worker.pool, request.pool_generation)
        copier = self.worker.disk
        if copier is None:
            raise FailedPreconditionError("the mapped pool has no disk tier (the memory service runs without "
                                          "--disk-cache-dir)", reason=POOL_NOT_MAPPED)
        receipts = await asyncio.get_running_loop().run_in_executor(self.disk_io, copier.run, request.copies)
        if self.worker.metrics is not None:
            done = [c.write for c, r in zip(request.copies, receipts) if r.ok]
            self.worker.metrics.observe_disk(writes=sum(done), reads=len(done) - sum(done))
        return pb.CopyDiskBlocksResponse(receipts=receipts)

    async def GetModelInfo(self, request, context):
        c = self.worker.config
        pool = self.worker.pool
        lay = pool.descriptor.layout if pool is not None else None
        return pb.GetModelInfoResponse(
            model_name=self.model_name,
            model_source=self.model_source,
            weights_path=self.weights_path,
            revision=self.revision,
            vocab_size=c.vocab_size,
            eos_token_ids=c.eos_token_ids,
            bos_token_id=c.bos_token_id,
            max_context=c.max_position_embeddings,
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=lay.dtype if lay else "",
            device=self.device,
            pool_generation=pool.generation if pool else 0,
            block_size=lay.block_size if lay else 0,
            num_blocks=lay.num_blocks if lay else 0,
            architecture=c.architecture,
            sliding_window=c.sliding_window or 0,
            generation_defaults=pb.GenerationDefaults(**{
                k: v for k, v in dataclasses.asdict(c.generation).items() if v is not None}),
            ignored_generation_keys=c.ignored_generation_keys,
            instance_id=self.instance_id,
            cpu_path=self.cpu_path,
            host_tier_page_locked=getattr(pool, "host_page_locked", None),
        )
