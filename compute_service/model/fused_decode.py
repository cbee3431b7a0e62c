"""When a step's decoder layers run as one native call, and the arguments of that call.

A decode-only step on a CPU whose projections run on a native kernel (`kernels.cpu.packed_linear`:
AMX or AVX-512 BF16 in bf16, AVX2 in fp32) runs every layer in `kernels.cpu.layers` (one native
call; the same kernels, order and buffers as the per-op path, so the same bits) instead of ~10
Python-to-native crossings a layer. `FusedDecode.build` checks once, when the model is built,
that every layer suits it (natively packed projections on one kernel and block width, without
biases, SwiGLU fused); `applies` checks a step (decode rows only, on the native decode kernel, a
pool of the model's dtype without fp8 scales, the metadata's dtypes and layouts), and `run` packs
the step's addresses.

Kept out of the architecture (`compute_service.model.llama` holds the per-op path, which stays the
reference and serves every other step).
"""

from __future__ import annotations

import array

import torch

from kernels.cpu import layers as cpu_layers
from kernels.cpu import native as cpu_native
from kernels.cpu import packed_linear


class FusedDecode:
    """The fused decode layers of one model (see the module docstring).

    Args:
        model: a `compute_service.model.llama.LlamaForPagedLM`, built.
        layers: its per-layer addresses [attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down, 0, 0]
            (the last two, the layer's caches, set per pool).
    """

    def __init__(self, model, layers: list[int], kernel: str, block: int) -> None:
        c = model.config
        self.dtype, self.kernel, self.block = model.dtype, kernel, block
        self.num_layers, self.inter = c.num_layers, c.intermediate_size
        self.hq, self.hkv, self.dh = c.num_q_heads, c.num_kv_heads, c.head_dim
        self.eps, self.scale = model.layers[0].attn_norm.eps, model.layers[0].attn.paged.scale
        self._layers = layers
        self._by_pool: dict[tuple, array.array] = {}  # (pool address, strides) -> layer array

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        """The fused path for `model`, or None when it cannot serve it (not on CPU, a projection not
        on the native kernel of the model's dtype, on another block width or with a bias, a SwiGLU
        that does not fuse, a norm epsilon that differs between layers, or the library unavailable
        here)."""
        if model.device.type != "cpu" or not cpu_layers.available(model.dtype):
            return None
        layers, eps, paths = [], model.layers[0].attn_norm.eps, set()
        for layer in model.layers:
            linears = (layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up, layer.mlp.w_down)
            if any(m.native is None or m.bias is not None for m in linears) or not linears[2].fuses_silu_mul():
                return None
            if {layer.attn_norm.eps, layer.mlp_norm.eps} != {eps}:
                return None
            paths |= {(m.native.kernel, m.native.block) for m in linears}
            layers += [layer.attn_norm.weight.data_ptr(), linears[0].native.address, linears[1].native.address,
                       layer.mlp_norm.weight.data_ptr(), linears[2].native.address, linears[3].native.address, 0, 0]
        if len(paths) != 1:
            return None
        (kernel, block), = paths
        return cls(model, layers, kernel, block)

    def applies(self, num_tokens: int, kv_pool: torch.Tensor, meta) -> bool:
        """Whether this step (a `compute_service.model.llama.StepMeta` over `kv_pool`) can run fused: every
        row a decode row on the native kernel, a CPU pool of the model's dtype without fp8 scales
        whose layers' caches the native kernels read, and metadata of the dtypes and layouts they take."""
        plan, decode = meta.plan, meta.plan.decode
        if (
            decode is None or plan.groups or plan.kernel != "torch" or meta.kv_scales is not None
            or kv_pool.dtype != self.dtype or not kv_pool.is_cpu or decode.seq_index.shape[0] != num_tokens
            or plan.total_q != num_tokens or not cpu_native.available()
        ):  # fmt: skip
            return False
        st = kv_pool.stride()
        slots, cos, sin = meta.slot_mapping, meta.cos, meta.sin
        return (
            st[5] == 1 and (st[4] == self.dh or self.hkv == 1)
            and plan.block_tables.dtype == plan.seq_lens.dtype == torch.int32
            and decode.seq_index.dtype == decode.q_index.dtype == slots.dtype == torch.int64
            and all(t.is_cpu and t.is_contiguous() for t in (plan.block_tables, plan.seq_lens, decode.seq_index,
                                                             decode.q_index, slots))
            and slots.shape == (num_tokens,)
            and all(t.dtype == self.dtype and t.is_cpu and t.shape == (num_tokens, 1, self.dh) and t.stride(2) == 1
                    for t in (cos, sin))
        )  # fmt: skip

    def run(self, x: torch.Tensor, kv_pool: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Every layer over the embeddings `x` [T, D] of the model's dtype (taken as the residual stream, updated in
        place). Returns (the last layer's MLP output [T, D], the residual stream [T, D], wall seconds
        in the cache writes and attention). Call only when `applies(T, kv_pool, meta)`.

        Raises:
            ValueError: a kernel refused the step (`kernels.cpu.layers.decode_layers`).
        """
        t, d = x.shape
        plan, decode = meta.plan, meta.plan.decode
        out, h, o = (torch.empty((t, d), dtype=self.dtype) for _ in range(3))
        qkv = torch.empty((t, (self.hq + 2 * self.hkv) * self.dh), dtype=self.dtype)
        attn = torch.empty((t, self.hq * self.dh), dtype=self.dtype)
        g = torch.empty((t, self.inter), dtype=self.dtype)
        st = kv_pool.stride()
        step = array.array("q", (
            x.data_ptr(), out.data_ptr(), h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), o.data_ptr(), g.data_ptr(),
            t, d, self.hq, self.hkv, self.dh, self.inter, meta.cos.data_ptr(), meta.sin.data_ptr(),
            meta.cos.stride(0), meta.sin.stride(0), meta.slot_mapping.data_ptr(), plan.block_tables.data_ptr(),
            plan.seq_lens.data_ptr(), decode.seq_index.data_ptr(), decode.q_index.data_ptr(),
            plan.block_tables.stride(0), kv_pool.shape[0], kv_pool.shape[3], st[0], st[3], st[4],
            torch.get_num_threads(), packed_linear.KERNELS[self.kernel].code, self.block,
            int(self.dtype == torch.bfloat16),
        ))  # fmt: skip
        seconds = cpu_layers.decode_layers(step, self._layers_for(kv_pool), self.num_layers, self.eps, self.scale)
        return out, x, seconds

    def _layers_for(self, kv_pool: torch.Tensor) -> array.array:
        """The per-layer array with this pool's caches (layer i's K at pool[:, i, 0], V at pool[:, i, 1])."""
        key = (kv_pool.data_ptr(), kv_pool.shape, kv_pool.stride())
        layers = self._by_pool.get(key)
        if layers is None:
            base, st, size = kv_pool.data_ptr(), kv_pool.stride(), kv_pool.element_size()
            layers = array.array("q", self._layers)
            for i in range(len(self._layers) // 8):  # every layer the model has
                layers[8 * i + 6] = base + i * st[1] * size
                layers[8 * i + 7] = base + (i * st[1] + st[2]) * size
            self._by_pool = {key: layers}  # one pool at a time: a remapped pool replaces it
        return layers


def cpu_path(model) -> str:
    """The CPU compute path of `model` (a built `compute_service.model.llama.LlamaForPagedLM`), for
    the worker's start log and GetModelInfo: "projections=<kernel> decode_layers=<fused|per-op>
    attention=<native|torch>", each with why not where it is not the fast one; "" on a GPU."""
    if model.device.type != "cpu":
        return ""
    native = model.layers[0].attn.wqkv.native
    if native is not None:
        projections = native.kernel
    elif model.layers[0].attn.wqkv.packed is not None:
        projections = f"onednn ({packed_linear.unavailable_reason(model.dtype)})"
    else:
        projections = "torch (not packed)"
    layers = "fused" if model.fused_decode is not None else (
        f"per-op ({cpu_layers.unavailable_reason(model.dtype) or 'a layer does not suit it'})")
    attention = "native" if cpu_native.available() else f"torch ({cpu_native.unavailable_reason})"
    return f"projections={projections} decode_layers={layers} attention={attention}"
