"""What ``pagedkv top`` draws from one dashboard snapshot (client.serve.dashboard.snapshot), with rich.

    counters      the pool's blocks by state, KV usage, prefix-cache hit rate, sequences and
                  leases, exactly as GetStats answered; preemptions; tokens/s now
    workers       each worker (of every node) with its state: ready, down (failed, probed until
                  it is back) or draining (no new work); since when, the requests and sequences
                  running on it, its failures and restarts
    pool grid     one character per block (``·`` free, ``▒`` cached, ``█`` used, a digit 2-9 or
                  ``+`` for a block shared by that many table entries), or, when the pool has
                  more blocks than fit, one character per run of blocks shaded by the used share
    requests      this front's running requests, a row per sequence with its block table
                  (``id*rc`` for shared blocks: the prompt blocks of n samples show ``*n``, their
                  copy-on-write tails stand alone), then the waiting ones, then other leases
"""

from __future__ import annotations

import math
import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

from client.serve.dashboard.block_states import CACHED, USED, unruns

#: Rows of the pool grid at most.
GRID_ROWS = 12
#: Block-table entries drawn per sequence at most.
MAX_TABLE_CELLS = 16
#: Sequences drawn per section at most.
MAX_ROWS = 32
_SHADES = "·░▒▓█"
#: How each worker state is drawn.
STATE_STYLES = {"ready": "bold green", "down": "bold red", "draining": "bold yellow"}


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def counters_table(snap: dict) -> Table:
    """The pool's counters (GetStats' numbers, the percentages computed from them here) and the front's rates."""
    st, c = snap["stats"], snap["counters"]
    now = c["now"]
    usage = st["used_blocks"] / st["total_blocks"] if st["total_blocks"] else 0.0
    hits = st["prefix_cache_hits"] / st["prefix_cache_queries"] if st["prefix_cache_queries"] else None
    t = Table(title="KV-cache pool", title_justify="left")
    for col in ("total", "used", "cached", "free", "KV usage", "prefix hits", "seqs", "leases", "preempt",
                "prompt tok/s", "output tok/s"):
        t.add_column(col, justify="right")
    t.add_row(str(st["total_blocks"]), str(st["used_blocks"]), str(st["cached_blocks"]), str(st["free_blocks"]),
              _pct(usage), _pct(hits), str(st["num_sequences"]),
              str(st["num_leases"]), str(c["preemptions"]), f"{now['prompt_tokens_per_s']:.1f}",
              f"{now['generation_tokens_per_s']:.1f}")
    return t


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


def workers_table(snap: dict) -> Table | None:
    """A row per worker (every node's) with its state; None for a snapshot without workers (an older server)."""
    workers = snap.get("workers")
    if not workers:
        return None
    c = snap["counters"]
    age = c.get("last_step_age_s")
    t = Table(title=f"Workers: {c.get('workers_ready', '?')} of {c.get('workers_total', '?')} ready, "
                    f"{c.get('worker_failovers', 0)} failovers, last step "
                    + ("none yet" if age is None else f"{_ago(age)} ago"), title_justify="left")
    nodes = any(w["node"] for w in workers)
    cols = ["worker", *(["node"] if nodes else []), "state", "for", "requests", "seqs", "waiting", "failures",
            "restarts"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("worker", "node", "state") else "right")
    for w in workers:
        since = "-" if w["since"] is None else _ago(snap["time"] - w["since"])
        t.add_row(w["address"], *([w["node"]] if nodes else []), Text(w["state"], STATE_STYLES.get(w["state"], "")),
                  since, str(w["requests"]), str(w["sequences"]), str(w["waiting"]), str(w["failures"]),
                  str(w["restarts"]))
    return t


def _block_char(state: int, refcount: int) -> tuple[str, str]:
    if state == USED:
        if refcount > 1:
            return (str(refcount) if refcount < 10 else "+"), "bold magenta"
        return "█", "green"
    if state == CACHED:
        return "▒", "blue"
    return "·", "grey50"


def pool_grid(pool: dict, width: int, rows: int = GRID_ROWS) -> Text:
    """The pool as characters, ``width`` per line, at most ``rows`` lines."""
    out = Text()
    room = max(1, width * rows)
    if pool["encoding"] == "blocks":
        states, refs = unruns(pool["state_runs"]), unruns(pool["refcount_runs"])
        per = math.ceil(len(states) / room) if states else 1
        if per == 1:
            cells = [_block_char(s, r) for s, r in zip(states, refs)]
        else:
            cells = [_shade(states[i:i + per].count(USED), states[i:i + per].count(CACHED), len(states[i:i + per]))
                     for i in range(0, len(states), per)]
        label = "1 block" if per == 1 else f"{per} blocks"
    else:
        cells_in = pool["cells"]
        n = len(cells_in["used"])
        group = math.ceil(n / room)
        cells = []
        for i in range(0, n, group):
            used, cached = sum(cells_in["used"][i:i + group]), sum(cells_in["cached"][i:i + group])
            total = used + cached + sum(cells_in["free"][i:i + group])
            cells.append(_shade(used, cached, total))
        label = f"{pool['blocks_per_cell'] * group} blocks"
    for i, (ch, style) in enumerate(cells):
        if i and i % width == 0:
            out.append("\n")
        out.append(ch, style)
    out.append(f"\n(one character: {label}; · free  ▒ cached  █ used  2-9 shared by that many)", "dim")
    return out


def _shade(used: int, cached: int, total: int) -> tuple[str, str]:
    if total == 0:
        return " ", ""
    if used == 0:
        return ("▒", "blue") if cached else ("·", "grey50")
    return _SHADES[max(1, round(used / total * (len(_SHADES) - 1)))], "green"


def _table_cells(s: dict) -> str:
    ids, refs = s.get("block_ids"), s.get("ref_counts")
    if ids is None:
        return "(not sent)"
    cells = [f"{b}*{r}" if refs is not None and r > 1 else str(b) for b, r in zip(ids, refs or [0] * len(ids))]
    if len(cells) > MAX_TABLE_CELLS:
        cells = cells[:MAX_TABLE_CELLS] + [f"… +{len(cells) - MAX_TABLE_CELLS}"]
    return " ".join(cells) or "-"


def requests_table(snap: dict) -> Table:
    """A row per sequence of the front's requests (running, then waiting) and of other leases."""
    t = Table(title="Block tables (block id, *refcount when shared)", title_justify="left")
    for col, justify in (("request", "left"), ("status", "left"), ("sample", "right"), ("seq", "right"),
                         ("tokens", "right"), ("block table", "left")):
        t.add_column(col, justify=justify)
    rows = 0
    for r in snap["requests"]["running"] + snap["requests"]["waiting"]:
        for s in r["sequences"]:
            if rows < MAX_ROWS:
                t.add_row(r["request_id"], r["status"], str(s["index"]),
                          "-" if s["seq_id"] is None else str(s["seq_id"]),
                          str(s["num_tokens"]), _table_cells(s) if s["seq_id"] is not None else "(no blocks)")
            rows += 1
    for lease in snap["leases"]:
        for s in lease["sequences"]:
            if rows < MAX_ROWS:
                t.add_row(f"lease {lease['lease_id'][:8]}", "swapped" if s["swapped"] else "", "", str(s["seq_id"]),
                          str(s["num_tokens"]), _table_cells(s))
            rows += 1
    if rows > MAX_ROWS:
        t.caption = f"{rows - MAX_ROWS} more sequences not shown"
    return t


def render(snap: dict, width: int = 100) -> Group:
    """One frame of ``pagedkv top`` for ``snap``, laid out for ``width`` columns."""
    head = Text(f"pagedkv top  {time.strftime('%H:%M:%S', time.localtime(snap['time']))}  snapshot {snap['seq']}  "
                f"({snap['scope']}{'' if snap['pool']['exact'] else '; block map approximate'})", "bold")
    running, waiting = snap["requests"]["running"], snap["requests"]["waiting"]
    summary = Text(f"running {len(running)}  waiting {len(waiting)}  other leases {len(snap['leases'])}")
    parts = [head, counters_table(snap)]
    workers = workers_table(snap)
    if workers is not None:
        parts.append(workers)
    parts.append(pool_grid(snap["pool"], max(10, width - 2)))
    if snap.get("host"):
        parts += [Text("host tier", "bold"), pool_grid(snap["host"], max(10, width - 2), rows=4)]
    parts += [summary, requests_table(snap)]
    return Group(*parts)


__all__ = ["counters_table", "pool_grid", "render", "requests_table", "workers_table"]
