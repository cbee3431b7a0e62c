"""A worker's fp8 KV scales: the pool's own, or calibrated once and set on the memory service.

An ``fp8_e4m3`` pool (``--kv-cache-dtype fp8``) stores keys and values divided by static scales
per (layer, KV head) (:mod:`pagedkv.runtime.kv_scales`; vLLM's fp8 KV cache with static scales). They are
fixed for a pool generation, carried in its descriptor, and every worker reads and writes with the
same ones. A worker that maps an fp8 pool without scales calibrates them (`calibrate`): it runs its
model over a fixed text (``kv_calibration.txt``: prose, code, dialogue, figures, a poem, JSON,
each passage a sequence of its own from position 0, the first ones also in the chat template) in
a scratch pool of the model's dtype, takes each (layer, K or V, KV head)'s largest magnitude
(amax), and sets

    scale = max(amax, tiny) * HEADROOM / 448          (448: float8 e4m3fn's largest value)

so that values up to HEADROOM x the calibration's largest are stored without saturating; e4m3's
relative precision is the same across its normal range (3 mantissa bits: at most 2^-4 relative
rounding error), so headroom costs only the smallest values, which fall into subnormals. It then
sends them with ``SetKvScales``, signed with the plane key, and uses whatever the memory service
kept (the first worker's, when several calibrate at once).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import grpc
import torch

from compute_service.model.llama import LayerScales, LlamaForPagedLM
from compute_service.model.packed_forward import packed_forward
from compute_service.pool_map import MappedPool
from pagedkv.config import FP8
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from pagedkv.runtime import tls
from pagedkv.runtime.kv_scales import FP8_MAX, check_scales, sign_scales
from pagedkv.runtime.logs import get_logger

log = get_logger("kv_calibration")

#: The fixed calibration text, passages separated by blank lines.
CALIBRATION_TEXT = Path(__file__).with_name("kv_calibration.txt")
#: Range kept above the calibration's largest magnitude (see the module docstring).
HEADROOM = 2.0
#: Longest calibration sequence, tokens.
MAX_SEQUENCE_TOKENS = 512
#: Passages also run in the model's chat template (as `pagedkv serve`'s chat requests are).
CHAT_PASSAGES = 3
_BLOCK_SIZE = 16


def calibration_sequences(model_source: str) -> list[list[int]]:
    """Token ids of the calibration text for the model at ``model_source`` (its own tokenizer):
    one sequence per passage, the first `CHAT_PASSAGES` also as a chat turn; at most
    `MAX_SEQUENCE_TOKENS` each.

    Raises:
        FileNotFoundError: no tokenizer for ``model_source``.
    """
    from pagedkv.model.tokenizer import load_tokenizer

    tok = load_tokenizer(model_source)
    passages = [p.strip() for p in CALIBRATION_TEXT.read_text().split("\n\n") if p.strip()]
    seqs = [tok.encode(p) for p in passages]
    if getattr(tok, "chat_template", None):
        for p in passages[:CHAT_PASSAGES]:
            seqs.append(list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)))
    return [s[:MAX_SEQUENCE_TOKENS] for s in seqs if s]


@torch.inference_mode()
def calibrate(model: LlamaForPagedLM, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Static fp8 KV scales of ``model`` from one prefill of ``sequences`` in a scratch pool.

    Returns:
        (k_scale, v_scale), each [num_layers, num_kv_heads] float32 on the CPU, finite and > 0.

    Raises:
        ValueError: no tokens to calibrate on.
    """
    c = model.config
    sequences = [s for s in sequences if s]
    if not sequences:
        raise ValueError("calibration needs at least one token")
    batch, first = [], 0
    for s in sequences:
        n = -(-len(s) // _BLOCK_SIZE)
        batch.append((list(range(first, first + n)), 0, s))
        first += n
    pool = torch.zeros(first, c.num_layers, 2, _BLOCK_SIZE, c.num_kv_heads, c.head_dim, dtype=model.dtype,
                       device=model.device)
    packed_forward(model, pool, batch)
    amax = pool.abs().amax(dim=(0, 3, 5)).float().cpu()  # [L, 2, Hkv]
    scales = amax.clamp_min(torch.finfo(torch.float32).tiny) * (HEADROOM / FP8_MAX)
    return scales[:, 0].contiguous(), scales[:, 1].contiguous()


def scale_rows(k_scale: torch.Tensor, v_scale: torch.Tensor) -> list[LayerScales]:
    """[num_layers, num_kv_heads] key and value scales as the model takes them: per layer
    (k_scale, v_scale), each a contiguous [num_kv_heads] row (views, no copy)."""
    return list(zip(k_scale.contiguous().unbind(0), v_scale.contiguous().unbind(0)))


def layer_scales(scales: mpb.KvScales, num_layers: int, num_kv_heads: int, device) -> list[LayerScales]:
    """``scales`` as the model takes them: per layer (k_scale, v_scale), [num_kv_heads] float32 on ``device``.

    Raises:
        ValueError: scales of the wrong count, or not finite and > 0.
    """
    check_scales(scales, num_layers, num_kv_heads, "the pool's kv_scales")
    k = torch.tensor(list(scales.k_scale), dtype=torch.float32).view(num_layers, num_kv_heads).to(device)
    v = torch.tensor(list(scales.v_scale), dtype=torch.float32).view(num_layers, num_kv_heads).to(device)
    return scale_rows(k, v)


def fit_kv_scales(pool: MappedPool, model: LlamaForPagedLM, model_source: str, memory: str,
                  files: tls.TlsFiles | None = None) -> None:
    """Give ``pool`` the scales its steps read and write with (``pool.kv_scales``): None for a pool
    that is not fp8; the descriptor's when set; else calibrated here and set on the memory service
    at ``memory`` (the kept ones are used, which may be another worker's).

    Raises:
        RuntimeError: the memory service refused the scales.
        ValueError: the descriptor's scales do not fit the pool.
    """
    desc = pool.descriptor
    lay = desc.layout
    if lay.dtype != FP8.name:
        pool.kv_scales = None
        return
    scales = desc.kv_scales if desc.HasField("kv_scales") else None
    if scales is None:
        k, v = calibrate(model, calibration_sequences(model_source))
        mine = mpb.KvScales(k_scale=k.flatten().tolist(), v_scale=v.flatten().tolist(),
                            source=f"calibration:{socket.gethostname()}/{os.getpid()}")
        request = mpb.SetKvScalesRequest(pool_generation=pool.generation, scales=mine,
                                         signature=sign_scales(pool.plane_key, pool.generation, mine))
        try:
            with tls.channel(memory, files) as ch:
                reply = mpb_grpc.MemoryServiceStub(ch).SetKvScales(request, timeout=10)
        except grpc.RpcError as e:
            raise RuntimeError(f"the memory service at {memory} refused this worker's fp8 KV scales: "
                               f"{e.code().name}: {e.details()}") from None
        scales = reply.scales
        log.info("kv_scales_calibrated", accepted=reply.accepted, source=scales.source,
                 k_scale_max=round(max(scales.k_scale), 6), v_scale_max=round(max(scales.v_scale), 6))
        desc.kv_scales.CopyFrom(scales)
    pool.kv_scales = layer_scales(scales, lay.num_layers, lay.num_kv_heads, pool.tensor.device)
