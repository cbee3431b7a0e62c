"""The compute worker's gRPC API (``pagedkv.compute.v1.ComputeService``).

``Step`` runs on the worker's one compute thread (the forward releases the GIL),
so health checks and GetModelInfo answer while a step computes; steps run one at
a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import Executor
from pathlib import Path

from compute_service.weights import smollm2_gguf_path
from compute_service.worker import Worker
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.compute.v1 import compute_service_pb2_grpc as pb_grpc
from pagedkv.service import map_errors
from pagedkv.tls import require_role

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ComputeService"].full_name


@map_errors
class ComputeServicer(pb_grpc.ComputeServiceServicer):
    """Serves one :class:`Worker`."""

    def __init__(self, worker: Worker, model_source: str, device: str, compute: Executor | None = None):
        self.worker = worker
        #: Where steps run (None: asyncio's default executor).
        self.compute = compute
        self.model_source = model_source
        self.device = device
        if model_source == "smollm2":
            self.model_name, self.weights_path = "SmolLM2-135M-Instruct", str(smollm2_gguf_path())
        else:
            self.model_name, self.weights_path = worker.config.name, str(Path(model_source).resolve())

    async def Step(self, request, context):
        require_role(context, {"scheduler"}, "Step")  # under TLS: schedulers (and the admin) only
        return await asyncio.get_running_loop().run_in_executor(self.compute, self.worker.step, request)

    async def GetModelInfo(self, request, context):
        c = self.worker.config
        pool = self.worker.pool
        lay = pool.descriptor.layout if pool is not None else None
        return pb.GetModelInfoResponse(
            model_name=self.model_name,
            model_source=self.model_source,
            weights_path=self.weights_path,
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
        )
