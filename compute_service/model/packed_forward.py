"""One model forward over packed sequences in a pool the caller owns, without a StepRequest.

The worker builds its steps from requests (`compute_service.step_inputs`); the fp8 calibration
pass (`compute_service.kv_calibration`), the KV-dtype benchmark and tests run the model over a
scratch pool of their own, with every row's logits when they want them. This is that forward:
block tables, slot mapping (``slot = table[p // block_size] * block_size + p % block_size``,
vLLM paper §4.1), query_start_loc and seq_lens derived from (block table, tokens cached, new
tokens) per sequence, the attention plan built once, the model run once.
"""

from __future__ import annotations

import torch

import kernels
from compute_service.model.llama import LayerScales, LlamaForPagedLM

#: One sequence of a batch: (block table, tokens already in the pool, new token ids).
Chunk = tuple[list[int], int, list[int]]


@torch.inference_mode()
def packed_forward(model: LlamaForPagedLM, pool: torch.Tensor, batch: list[Chunk],
                   kv_scales: list[LayerScales] | None = None, all_rows: bool = False) -> torch.Tensor:
    """Write ``batch``'s new tokens' K/V into ``pool`` and return float32 logits.

    Args:
        model: the model (its device is the pool's).
        pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] in any pool dtype.
        batch: per sequence (block table, tokens already cached, new token ids); each table covers
            its sequence's tokens after this forward.
        kv_scales: an fp8 pool's per-layer scales (`LlamaForPagedLM.forward`); None otherwise.
        all_rows: every new token's logits ([T, vocab]) instead of each sequence's last ([S, vocab]).

    Raises:
        ValueError: a table too short for its sequence, or what the model raises.
    """
    block_size, dev = pool.shape[3], model.device
    lens = [len(t) for _, _, t in batch]
    ends = [start + n for (_, start, _), n in zip(batch, lens)]
    short = [i for i, ((table, _, _), end) in enumerate(zip(batch, ends)) if len(table) * block_size < end]
    if short:
        raise ValueError(f"sequences {short} need more blocks than their tables hold ({block_size} tokens a block)")
    width = max(len(table) for table, _, _ in batch)
    tables = torch.tensor([table + [0] * (width - len(table)) for table, _, _ in batch], dtype=torch.int32)
    positions = torch.cat([torch.arange(start, end) for (_, start, _), end in zip(batch, ends)])
    blocks = torch.cat([tables[i, torch.arange(start, end) // block_size].long()
                        for i, ((_, start, _), end) in enumerate(zip(batch, ends))])
    slots = blocks * block_size + positions % block_size
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(ends, dtype=torch.int32)
    plan = kernels.plan_attention(tables.to(dev), qsl.to(dev), seq_lens.to(dev), block_size,
                                  host_query_start_loc=qsl, host_seq_lens=seq_lens, num_kv_heads=pool.shape[4])
    rows = torch.arange(int(qsl[-1])) if all_rows else (qsl[1:] - 1).long()
    ids = torch.tensor([t for _, _, new in batch for t in new], dtype=torch.int64)
    return model(ids.to(dev), positions.to(dev), pool, slots.to(dev), plan, rows.to(dev), kv_scales)
