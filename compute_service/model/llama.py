"""A Llama-family decoder that reads and writes its KV cache in the paged block pool.

One forward runs a *packed* batch: the new tokens of every sequence laid end to end (T tokens
for S sequences), whatever mix of prefill chunks and decode tokens it holds. Per layer, the new
K/V are written into their slots (`kernels.reshape_and_cache`), then every new query attends
causally over its sequence's paged context (`kernels.paged_attention`, PagedAttention, Kwon et
al. SOSP 2023, §4.1). The attention plan (`kernels.plan_attention`: metadata checked on the host,
kernel chosen) is built once per step by the caller and shared by every layer. Only the logits
the caller asks for are computed. A decode-only bf16 step on an AMX CPU runs the same ops, in
the same order, as one native call for all layers (`compute_service.model.fused_decode`).

Architecture as in Hugging Face `LlamaForCausalLM` (RMSNorm, RoPE with rotate-half, GQA, SwiGLU,
optional tied embeddings, optional projection biases), which also covers `MistralForCausalLM`
and `Qwen2ForCausalLM` (q/k/v biases); layout of the file after gpt-fast's model.py: the architecture only.
Q/K/V and gate/up projections are fused into one matmul each; the projections are
`compute_service.model.linear.Linear` (oneDNN's prepacked matmul on CPU, fp32 or bf16). The elementwise ops
(RMSNorm with the residual add fused in, as vLLM's `fused_add_rms_norm`; silu(gate) * up; RoPE)
are `kernels.fused_ops`: one native call each on CPU, torch ops elsewhere. Timing hooks in from
outside (`compute_service.timing`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from compute_service.model.fused_decode import FusedDecode
from compute_service.model.linear import Linear, packed_linear_wanted
from compute_service.weights.checkpoint import WeightSource, as_weight_source
from compute_service.weights.loader import WeightLoader
from compute_service.weights.source import REQUIRED_BIASES, ModelConfig, Weights
from kernels import fused_ops
from kernels.fused_ops import signed_sin

#: One layer's fp8 KV scales: (k_scale, v_scale), each [num_kv_heads] float32 on the model's device.
LayerScales = tuple[torch.Tensor, torch.Tensor]


def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2] fp32 (radians per position) with scaling applied.

    Follows transformers' `modeling_rope_utils` (default, linear, llama3). `rope_freqs`
    (llama.cpp's per-frequency divisors, shape [head_dim // 2]) divides the result when given.
    """
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = config.rope_scaling
    if sc is not None and sc.kind == "linear":
        inv = inv / sc.factor
    elif sc is not None and sc.kind == "llama3":
        old = sc.original_max_position_embeddings
        low_wavelen, high_wavelen = old / sc.low_freq_factor, old / sc.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
        smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
        smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    if rope_freqs is not None:
        inv = inv / rope_freqs.float()
    return inv


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, D]; residual: [T, D] or None. With a residual, vLLM's fused add: residual += x in
        # place (the residual stream), then the norm of the sum. Statistics and scaling in fp32,
        # one rounding at the end (transformers' LlamaRMSNorm rounds x * rsqrt(...) to the input
        # dtype before the weight multiply: the same arithmetic in fp32, within one bf16 ulp).
        if residual is None:
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)


@dataclass(slots=True)
class StepMeta:
    """Per-forward attention metadata shared by every layer."""

    cos: torch.Tensor  # [T, 1, head_dim] model dtype, each frequency twice
    sin: torch.Tensor  # [T, 1, head_dim], first half negated (`kernels.fused_ops.apply_rope`)
    slot_mapping: torch.Tensor  # [T] int64, pool slot of each new token
    plan: kernels.AttentionPlan  # the step's attention metadata and kernel, shared by all layers
    # An fp8 pool's static scales: layer i's (k_scale [Hkv], v_scale [Hkv]) float32; else None.
    kv_scales: Sequence[LayerScales] | None = None


class PagedAttention(nn.Module):
    """Write this step's K/V into their slots, then attend each query over its paged context.

    No weights: the paged KV cache itself (vLLM's `Attention` layer over its backend, PagedAttention
    §4.1). A module of its own so that `compute_service.timing` can hook it.
    """

    def __init__(self, scale: float, layer: int) -> None:
        super().__init__()
        self.scale, self.layer = scale, layer

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: StepMeta,
    ) -> torch.Tensor:
        # q: [T, Hq, Dh]; k, v: [T, Hkv, Dh]; key_cache, value_cache: [num_blocks, block_size, Hkv, Dh]
        # The cache write on the plan's backend: a Triton plan's padded rows (slot -1) are skipped there.
        backend = meta.plan.backend
        if meta.kv_scales is None:
            kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, backend=backend)
            return kernels.paged_attention(q, key_cache, value_cache, meta.plan, self.scale)  # [T, Hq, Dh]
        ks, vs = meta.kv_scales[self.layer]  # fp8: quantized on write, dequantized inside the kernel
        kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, k_scale=ks, v_scale=vs,
                                  backend=backend)
        return kernels.paged_attention(q, key_cache, value_cache, meta.plan, self.scale, k_scale=ks, v_scale=vs)


class Attention(nn.Module):
    """GQA self-attention over the paged cache; Q/K/V fused into one projection (with the q/k/v
    biases of Qwen2 / Llama's `attention_bias`, concatenated alike)."""

    def __init__(self, c: ModelConfig, wqkv: Linear, wo: Linear, layer: int) -> None:
        # wqkv: D -> (Hq + 2 Hkv) * Dh, rows wq | wk | wv (bias bq | bk | bv); wo: Hq * Dh -> D
        super().__init__()
        self.wqkv, self.wo = wqkv, wo
        self.hq, self.hkv, self.dh = c.num_q_heads, c.num_kv_heads, c.head_dim
        self.paged = PagedAttention(c.head_dim**-0.5, layer)

    def forward(
        self, x: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: StepMeta
    ) -> torch.Tensor:
        # x: [T, D]; key_cache, value_cache: [num_blocks, block_size, Hkv, Dh] views of the pool
        t = x.shape[0]
        qkv = self.wqkv(x).view(t, self.hq + 2 * self.hkv, self.dh)  # [T, Hq + 2 Hkv, Dh]
        qk = fused_ops.rope(qkv[:, : self.hq + self.hkv], meta.cos, meta.sin)  # queries and keys at once
        q, k = qk.split([self.hq, self.hkv], dim=1)  # [T, Hq, Dh], [T, Hkv, Dh] (row-strided views)
        v = qkv[:, self.hq + self.hkv :]  # [T, Hkv, Dh]
        o = self.paged(q, k, v, key_cache, value_cache, meta)  # [T, Hq, Dh]
        return self.wo(o.reshape(t, self.hq * self.dh))  # [T, D]


class MLP(nn.Module):
    """SwiGLU: w_down(silu(x w_gate^T) * (x w_up^T)), gate and up fused into one projection that
    also applies the activation (`Linear.forward(silu_mul=True)`)."""

    def __init__(self, w_gate_up: Linear, w_down: Linear) -> None:
        # w_gate_up: D -> 2I, rows w_gate | w_up; w_down: I -> D
        super().__init__()
        self.w_gate_up, self.w_down = w_gate_up, w_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D]
        return self.w_down(self.w_gate_up(x, silu_mul=True))  # [T, I] (silu(gate) * up) -> [T, D]


class DecoderLayer(nn.Module):
    """Pre-norm block: attention then SwiGLU MLP, each after an RMSNorm, with residual adds.

    Built from `load`: layer i's tensors, one fused projection at a time.
    """

    def __init__(self, c: ModelConfig, load: WeightLoader, i: int) -> None:
        super().__init__()
        p = f"layers.{i}."
        self.attn_norm = RMSNorm(load([p + "attn_norm"]), c.rms_norm_eps)
        self.attn = Attention(
            c,
            load.linear([p + "wq", p + "wk", p + "wv"], [p + "bq", p + "bk", p + "bv"]),
            load.linear([p + "wo"], [p + "bo"]),
            i,
        )
        self.mlp_norm = RMSNorm(load([p + "mlp_norm"]), c.rms_norm_eps)
        self.mlp = MLP(
            load.linear([p + "w_gate", p + "w_up"], [p + "b_gate", p + "b_up"]),
            load.linear([p + "w_down"], [p + "b_down"]),
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: StepMeta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, D] the previous layer's MLP output (the embeddings at layer 0); residual: [T, D]
        # the stream before it (None at layer 0). The stream grows in place, vLLM's layout:
        # stream = x + attn(norm(x)); stream += mlp(norm(stream)), adds fused into the norms.
        if residual is None:
            residual, h = x, self.attn_norm(x)
        else:
            h = self.attn_norm(x, residual)  # residual += x
        h = self.mlp_norm(self.attn(h, key_cache, value_cache, meta), residual)  # residual += attn
        return self.mlp(h), residual  # [T, D], [T, D]


class LlamaForPagedLM(nn.Module):
    """Llama-family decoder over a paged KV pool; returns the logits of chosen packed tokens.

    Runs Hugging Face's LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM (the same
    block; Qwen2 adds q/k/v biases, Llama may have `attention_bias` / `mlp_bias`). Attention is
    full causal: a model with a sliding window (`config.sliding_window`) is exact only while
    every position is below the window, which the worker enforces (`compute_service.worker`).

    Args:
        config: model shape (see `compute_service.weights.source.ModelConfig`).
        weights: tensors in our naming (see `compute_service.weights.source`), a lazy
            `compute_service.weights.checkpoint.WeightSource` or a dict; read one tensor (or fused
            projection) at a time, converted straight to device/dtype, so that host memory peaks
            near the final weights, never at a second full copy.
        device: where to run ("cpu" or a CUDA device).
        dtype: weight and activation dtype (float32 or bfloat16 on CPU, bfloat16 on CUDA).

    Raises ValueError when a weight is missing or has the wrong shape (checked before any is read).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.device, self.dtype = torch.device(device), dtype
        source = as_weight_source(weights)
        _check_shapes(config, source)
        packed = packed_linear_wanted(self.device, dtype)
        load = WeightLoader(source, self.device, dtype, packed, _largest_projection(config))
        self.embed = nn.Parameter(load(["embed"]), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, load, i) for i in range(config.num_layers))
        self.norm = RMSNorm(load(["norm"]), config.rms_norm_eps)
        # Tied: the head shares the embedding's values (a packed copy when packing).
        self.lm_head = (Linear(self.embed.data, packed) if config.tie_word_embeddings
                        else load.linear(["lm_head"]))
        load.release()
        rope_freqs = source.fetch(["rope_freqs"], "cpu", torch.float32) if "rope_freqs" in source else None
        self.register_buffer("inv_freq", rope_inv_freq(config, rope_freqs).to(self.device), persistent=False)
        self.eval()
        #: Decode-only steps on a native projection kernel: every layer in one native call (None: per op only).
        self.fused_decode = FusedDecode.build(self)
        #: Wall seconds the last forward's fused layers spent writing K/V and in attention (0 otherwise).
        self.native_attention_seconds = 0.0

    def nbytes(self) -> int:
        """Bytes of every weight the model holds (packed projections at their packed size)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        inside = {id(p) for m in linears for p in m.parameters()}
        rest = [p for p in self.parameters() if id(p) not in inside]
        return sum(m.nbytes() for m in linears) + sum(p.nbytes for p in rest) + self.inv_freq.nbytes

    @torch.inference_mode()
    def forward(self, *args, **kwargs) -> torch.Tensor:  # [S', vocab] float32
        """One model step: `hidden_states` (same arguments), then `compute_logits`."""
        return self.compute_logits(self.hidden_states(*args, **kwargs))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S', D] (final-normed, `hidden_states`) -> logits [S', vocab] float32 (the LM head)."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] int64, new tokens of all sequences, packed
        positions: torch.Tensor,  # [T] int64, position of each new token in its sequence
        kv_pool: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, Hkv, Dh]
        slot_mapping: torch.Tensor,  # [T] int64, block * block_size + offset of each new token
        plan: kernels.AttentionPlan,  # this step's attention plan (block tables, lengths, kernel)
        logits_indices: torch.Tensor,  # [S'] int64, packed rows whose logits to return
        kv_scales: Sequence[LayerScales] | None = None,  # fp8 pool: per layer (k_scale [Hkv], v_scale [Hkv])
    ) -> torch.Tensor:  # [S', D]
        """One model step up to the LM head: writes the new tokens' K/V into the pool, returns the
        final-normed hidden states of the chosen rows (`compute_logits` turns them into logits; a
        CUDA graph captures this part only, vLLM's split, so that no graph holds a vocabulary-wide
        output).

        `plan` is `kernels.plan_attention(block_tables, query_start_loc, seq_lens, block_size,
        host_query_start_loc=..., host_seq_lens=..., num_kv_heads=...)` of the step (see
        `compute_service.step_inputs.StepInputs.attention_plan`), built once on the host. New
        token j of a sequence with n new tokens sits at position seq_len - n + j and sees
        positions [0, seq_len - n + j] (causal, bottom-right aligned). Every tensor must be on
        the model's device; the pool may be any dtype the kernels accept. An fp8 (float8_e4m3fn)
        pool needs `kv_scales`, one (k_scale, v_scale) pair of [num_kv_heads] float32 tensors per
        layer (`compute_service.kv_calibration`): keys and values are stored divided by them and
        read multiplied by them (`kernels.fp8`). Raises ValueError when the pool's layout does not
        match the model, the plan the pool's block size, or the scales the pool's dtype.
        """
        # input_ids, positions, slot_mapping: [T]; kv_pool: [N, L, 2, B, Hkv, Dh] -> [S', vocab]
        c = self.config
        if (
            kv_pool.dim() != 6
            or kv_pool.shape[1] != c.num_layers
            or kv_pool.shape[2] != 2
            or kv_pool.shape[4:] != (c.num_kv_heads, c.head_dim)
        ):
            raise ValueError(
                f"kv_pool shape {tuple(kv_pool.shape)} does not match the model: expected "
                f"[num_blocks, {c.num_layers}, 2, block_size, {c.num_kv_heads}, {c.head_dim}]"
            )
        if plan.block_size != kv_pool.shape[3]:
            raise ValueError(f"the attention plan is for block size {plan.block_size}, "
                             f"the pool's is {kv_pool.shape[3]}")
        if (kv_pool.dtype == kernels.FP8_DTYPE) != (kv_scales is not None) or (
            kv_scales is not None and len(kv_scales) != c.num_layers
        ):
            raise ValueError(
                f"a {kv_pool.dtype} pool takes "
                + (
                    f"kv_scales: one (k_scale, v_scale) pair per layer ({c.num_layers})"
                    if kv_pool.dtype == kernels.FP8_DTYPE
                    else "no kv_scales"
                )
            )
        # positions: [T] -> cos, sin: [T, 1, Dh]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        freqs = torch.cat((freqs, freqs), dim=-1)
        meta = StepMeta(
            freqs.cos()[:, None].to(self.dtype),
            signed_sin(freqs.sin()[:, None]).to(self.dtype),
            slot_mapping,
            plan,
            kv_scales,
        )
        x, residual = F.embedding(input_ids, self.embed), None  # [T, D]; the stream starts at layer 0
        self.native_attention_seconds = 0.0
        if self.fused_decode is not None and self.fused_decode.applies(x.shape[0], kv_pool, meta):
            x, residual, self.native_attention_seconds = self.fused_decode.run(x, kv_pool, meta)  # same bits
        else:
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, kv_pool[:, i, 0], kv_pool[:, i, 1], meta)
        return self.norm(x[logits_indices], residual[logits_indices])  # [S', D]: last add, final norm


def _largest_projection(c: ModelConfig) -> int:
    """Elements of the largest (fused) projection weight of config `c`."""
    qkv = (c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return max(qkv, c.num_q_heads * c.head_dim * c.hidden_size, 2 * c.intermediate_size * c.hidden_size, head)


def _check_shapes(c: ModelConfig, w: WeightSource) -> None:
    """Raise ValueError naming the first missing or misshapen weight (bias) of config `c`."""
    d, i, qd, kd = (
        c.hidden_size,
        c.intermediate_size,
        c.num_q_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
    )
    want = {"embed": (c.vocab_size, d), "norm": (d,)}
    if not c.tie_word_embeddings:
        want["lm_head"] = (c.vocab_size, d)
    biases = {"bq": (qd,), "bk": (kd,), "bv": (kd,), "bo": (d,), "b_gate": (i,), "b_up": (i,), "b_down": (d,)}
    required = REQUIRED_BIASES.get(c.architecture, ())
    optional = {"rope_freqs": (c.head_dim // 2,)}
    for n in range(c.num_layers):
        p = f"layers.{n}."
        want.update(
            {
                p + "attn_norm": (d,),
                p + "wq": (qd, d),
                p + "wk": (kd, d),
                p + "wv": (kd, d),
                p + "wo": (d, qd),
                p + "mlp_norm": (d,),
                p + "w_gate": (i, d),
                p + "w_up": (i, d),
                p + "w_down": (d, i),
            }
        )
        for b, shape in biases.items():
            (want if b in required else optional)[p + b] = shape
    for name, shape in want.items():
        if name not in w:
            raise ValueError(f"weight {name!r} missing (expected shape {list(shape)})")
    for name, shape in (want | optional).items():
        if name in w and tuple(w.shape(name)) != shape:
            raise ValueError(f"weight {name!r} has shape {list(w.shape(name))}, expected {list(shape)}")
