"""Tables of the pool and its sequences (``pagedkv stats`` and the demo), drawn with rich."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def stats_table(stats) -> Table:
    """The pool's counters: blocks by state, tokens, utilization, leases, failures."""
    t = Table(title="KV-cache pool", show_header=True)
    for col in ("total", "used", "free", "cached", "avail", "block", "tokens", "util",
                "seqs", "leases", "shared", "preempt", "fails"):
        t.add_column(col, justify="right")
    t.add_row(*map(str, (stats.total_blocks, stats.used_blocks, stats.free_blocks, stats.cached_blocks,
                         stats.available_blocks, stats.block_size, stats.tokens_stored)),
              f"{stats.utilization:.1%}", *map(str, (stats.num_sequences, stats.num_leases, stats.shared_block_refs,
                                                    stats.preemptions, stats.allocation_failures)))
    return t


def sequences_table(sequences, labels: dict[int, str] | None = None, max_blocks: int = 12) -> Table:
    """One row per sequence: its block ids with refcounts (``id*rc`` when shared)."""
    t = Table(title="Block tables (block id, *refcount when shared)", show_header=True)
    t.add_column("seq", justify="right")
    if labels is not None:
        t.add_column("request")
    t.add_column("tokens", justify="right")
    t.add_column("blocks", justify="right")
    t.add_column("shared", justify="right")
    t.add_column("block table")
    for s in sequences:
        cells = [f"{b}*{rc}" if rc > 1 else str(b) for b, rc in zip(s.block_ids, s.ref_counts)]
        if len(cells) > max_blocks:
            cells = cells[:max_blocks] + [f"... +{len(cells) - max_blocks}"]
        shared = sum(rc > 1 for rc in s.ref_counts)
        row = [str(s.seq_id)] + ([labels.get(s.seq_id, "")] if labels is not None else [])
        t.add_row(*row, str(s.num_tokens), str(len(s.block_ids)), str(shared), " ".join(cells))
    return t


def print_stats(stats, sequences, labels: dict[int, str] | None = None, console: Console | None = None) -> None:
    """Print both tables."""
    console = console or Console(width=140)
    console.print(stats_table(stats))
    console.print(sequences_table(sequences, labels))
