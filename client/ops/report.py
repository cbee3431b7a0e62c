"""Tables of the pool and its sequences (``pagedkv stats`` and the demo), drawn with rich.

Rich lays out a table cell by cell (seconds for 10,000 rows), so past :data:`RICH_MAX_ROWS`
sequences the block tables print as plain aligned text with the same columns.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from pagedkv.memory.v1 import memory_service_pb2 as mpb


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


def sizing_table(stats) -> Table:
    """How the pool was sized (GetStats ``sizing``): what sized it, its capacity in blocks and tokens,
    and with ``--gpu-memory-utilization`` the budget's terms (F x device - W x (weights + reserve))."""
    z = stats.sizing
    source = mpb.PoolSizingSource.Name(z.source).removeprefix("POOL_SIZING_SOURCE_").lower()
    t = Table(title="Pool sizing", show_header=True)
    cols = ["sized by", "blocks", "tokens", "GiB"]
    row = [source, str(stats.total_blocks), str(stats.token_capacity), f"{stats.pool_bytes / 2**30:.2f}"]
    if z.source == mpb.POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION:
        cols += ["F", "device GiB", "workers", "weights GiB", "reserve GiB", "at tokens"]
        row += [f"{z.utilization:g}", f"{z.device_total_bytes / 2**30:.2f}", str(z.workers_per_device),
                f"{z.weight_bytes / 2**30:.2f} ({z.weights_from})", f"{z.reserve_bytes / 2**30:.2f}",
                str(z.max_num_batched_tokens)]
    for col in cols:
        t.add_column(col, justify="left" if col == "sized by" else "right")
    t.add_row(*row)
    return t


def host_table(stats) -> Table:
    """The host tier's counters (``--host-cache-memory``): blocks by state, offloads, reloads, swaps."""
    t = Table(title="Host tier", show_header=True)
    for col in ("total", "used", "free", "cached", "offloads", "reloads", "hits", "swap out", "swap in",
                "swapped", "evictions"):
        t.add_column(col, justify="right")
    t.add_row(*map(str, (stats.host_total_blocks, stats.host_used_blocks, stats.host_free_blocks,
                         stats.host_cached_blocks, stats.offloads, stats.reloads,
                         stats.host_cache_hits, stats.swap_outs, stats.swap_ins, stats.swapped_sequences,
                         stats.host_cache_evictions)))
    return t


def disk_table(stats) -> Table:
    """The disk tier's counters (``--disk-cache-dir``): blocks and bytes on disk, reads, writes, drops,
    checksum failures, blocks found at start."""
    d = stats.disk
    t = Table(title="Disk tier", show_header=True)
    for col in ("blocks", "MiB", "slots", "hits", "writes", "reads", "dropped", "checksum fails", "evictions",
                "recovered"):
        t.add_column(col, justify="right")
    t.add_row(str(d.blocks), f"{d.bytes / 2**20:.1f}", *map(str, (d.slots, d.hits, d.writes, d.reads, d.dropped,
                                                                   d.checksum_failures, d.evictions, d.recovered)))
    return t


def pins_summary(stats) -> str:
    """The prefix pins' totals: pinned blocks and tokens, cached blocks left with a retention
    priority, pins ended by their TTL."""
    p = stats.pins
    return (f"Prefix pins: {p.num_pins} live, {p.pinned_blocks} blocks, {p.pinned_tokens} tokens; "
            f"{p.retained_blocks} cached blocks with a retention priority; {p.expired} expired")


def pins_table(pins) -> Table:
    """Prefix pins (PinPrefix): one row per pin of ``pins`` (ListPins)."""
    t = Table(title="Prefix pins", show_header=True)
    for col, justify in (("pin", "left"), ("label", "left"), ("seq", "right"), ("tokens", "right"),
                         ("blocks", "right"), ("priority", "right"), ("ends in s", "right")):
        t.add_column(col, justify=justify)
    for pin in pins:
        t.add_row(pin.pin_id, pin.label, str(pin.seq_id), str(pin.num_tokens), str(len(pin.block_ids)),
                  str(pin.priority), f"{pin.expires_in_seconds:.0f}")
    return t


#: Most sequences drawn as a rich table; more print as plain text.
RICH_MAX_ROWS = 200


def _cells(s, max_blocks: int) -> tuple[str, int]:
    """(the block table as ``id`` / ``id*rc`` cells, shared block count) of one sequence."""
    cells = [f"{b}*{rc}" if rc > 1 else str(b) for b, rc in zip(s.block_ids, s.ref_counts)]
    if len(cells) > max_blocks:
        cells = cells[:max_blocks] + [f"... +{len(cells) - max_blocks}"]
    return " ".join(cells), sum(rc > 1 for rc in s.ref_counts)


def sequences_text(sequences, labels: dict[int, str] | None = None, max_blocks: int = 12) -> str:
    """The rows of :func:`sequences_table` as plain aligned text (fast for any count), one line each."""
    head = ["seq", *(["request"] if labels is not None else []), "tokens", "blocks", "shared", "block table"]
    rows = [head]
    for s in sequences:
        table, shared = _cells(s, max_blocks)
        rows.append([str(s.seq_id), *([labels.get(s.seq_id, "")] if labels is not None else []), str(s.num_tokens),
                     str(len(s.block_ids)), str(shared), table])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    title = f"Block tables of {len(rows) - 1} sequences (block id, *refcount when shared)"
    return "\n".join([title, *("  ".join([*(c.rjust(w) for c, w in zip(r, widths)), r[-1]]) for r in rows)])


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
        table, shared = _cells(s, max_blocks)
        row = [str(s.seq_id)] + ([labels.get(s.seq_id, "")] if labels is not None else [])
        t.add_row(*row, str(s.num_tokens), str(len(s.block_ids)), str(shared), table)
    return t


def print_stats(stats, sequences, labels: dict[int, str] | None = None, console: Console | None = None,
                pins=()) -> None:
    """Print the tables (the block tables as plain text past :data:`RICH_MAX_ROWS` sequences); the
    prefix pins' when there are any (``pins``: ListPins) or cached blocks they left."""
    console = console or Console(width=140)
    console.print(stats_table(stats))
    if stats.HasField("sizing"):
        console.print(sizing_table(stats))
    if stats.host_total_blocks:
        console.print(host_table(stats))
    if stats.HasField("disk"):
        console.print(disk_table(stats))
    if pins or stats.pins.num_pins or stats.pins.retained_blocks:
        console.print(pins_summary(stats))
        if pins:
            console.print(pins_table(pins))
    if len(sequences) <= RICH_MAX_ROWS:
        console.print(sequences_table(sequences, labels))
    else:
        console.file.write(sequences_text(sequences, labels) + "\n")
