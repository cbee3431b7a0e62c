"""The disk tier's files: one file per block vs slots in preallocated slab files, buffered vs O_DIRECT.

Writes then reads ``--blocks`` KV blocks of a real block size (SmolLM2-135M in bf16 at block size
16: 30 layers x 2 x 16 x 3 heads x 64 x 2 bytes = 368,640 bytes; a Llama-3-8B block: 2 MiB) the
way a worker would, the checksum (SHA-256) computed on write and checked on read, headers
included (`compute_service.disk_io`):

- **file per block**: create, write, close one file per block; read it back by opening it (what a
  simple store does: LMCache's local disk backend keeps a file per chunk);
- **slab, buffered**: ``pwrite``/``pread`` into one preallocated file through the page cache;
- **slab, O_DIRECT**: the same, bypassing the page cache (4 KiB aligned slots and buffers).

Reads come right after the writes, so buffered reads mostly hit the page cache (what a warm node
sees); O_DIRECT reads always go to the device. Eviction cost: deleting files vs nothing (a slab
slot is reused in place). Side by side in one run; a table and a plot.

    python benchmarks/bench_disk_io.py [--quick] [--dir PATH]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from common import fmt, machine, pyplot, save_plot, table, write_result

from compute_service.disk_io import SlabIO, header_for, open_slab
from pagedkv.runtime.disk_block import checksum, pack_header, slot_bytes, unpack_header

SIZES = {"smollm2 bf16 (360 KiB)": 368_640, "llama3-8b bf16 (2 MiB)": 2 << 20}


def headers(blocks: list[np.ndarray]):
    return [header_for(b, identity=bytes(32), block_hash=i.to_bytes(32, "little"), parent_hash=None,
                       tokens=range(16), sequence=i) for i, b in enumerate(blocks)]


def file_per_block(folder: Path, blocks: list[np.ndarray]) -> tuple[float, float, float]:
    """(write s, read s, evict s) with a file per block."""
    t = time.perf_counter()
    for i, (b, h) in enumerate(zip(blocks, headers(blocks))):  # checksums computed as the worker does
        tmp = folder / f"{i}.tmp"
        with open(tmp, "wb") as f:
            f.write(pack_header(h))
            f.write(memoryview(b))
        os.replace(tmp, folder / f"{i}.blk")  # the rename commits the block
    t_write = time.perf_counter() - t
    t = time.perf_counter()
    for i, b in enumerate(blocks):
        with open(folder / f"{i}.blk", "rb") as f:
            raw = f.read()
        h = unpack_header(raw[:4096])
        assert h is not None and checksum(raw[4096:4096 + b.nbytes]) == h.checksum
    t_read = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(len(blocks)):
        os.unlink(folder / f"{i}.blk")
    return t_write, t_read, time.perf_counter() - t


def slab(folder: Path, blocks: list[np.ndarray], direct: bool) -> tuple[float, float, float, bool]:
    """(write s, read s, evict s, O_DIRECT on) with one preallocated slab."""
    size = slot_bytes(blocks[0].nbytes)
    path = folder / "slab.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, size * len(blocks))
    os.close(fd)
    fd, on = open_slab(str(path), direct)
    io = SlabIO(fd, size, on)
    t = time.perf_counter()
    hdrs = headers(blocks)  # checksums computed as the worker does
    for i, (b, h) in enumerate(zip(blocks, hdrs)):
        io.write(i, h, b)
    t_write = time.perf_counter() - t
    into = np.empty(blocks[0].nbytes, dtype=np.uint8)
    t = time.perf_counter()
    for i, h in enumerate(hdrs):
        assert io.read(i, into, block_hash=h.block_hash).ok
    t_read = time.perf_counter() - t
    io.close()
    path.unlink()
    return t_write, t_read, 0.0, on


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer blocks")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        for label, nbytes in SIZES.items():
            n = max(16, (64 if args.quick else 512) * 368_640 // nbytes)
            rng = np.random.default_rng(0)
            blocks = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]
            total = n * nbytes / 1e9
            for layout in ("file per block", "slab, buffered", "slab, O_DIRECT"):
                if layout == "file per block":
                    w, r, e, direct = (*file_per_block(folder, blocks), False)
                else:
                    w, r, e, direct = slab(folder, blocks, layout.endswith("O_DIRECT"))
                rows.append({"block": label, "blocks": n, "layout": layout, "o_direct": direct,
                             "write_gbs": total / w, "read_gbs": total / r, "evict_ms": e * 1e3,
                             "write_us_per_block": w / n * 1e6, "read_us_per_block": r / n * 1e6})
    table("Disk tier files: write, read (with checksums), evict",
                ["block", "n", "layout", "O_DIRECT", "write GB/s", "read GB/s", "us/block w", "us/block r",
                 "evict all ms"],
                [[r["block"], r["blocks"], r["layout"], r["o_direct"], fmt(r["write_gbs"]), fmt(r["read_gbs"]),
                  fmt(r["write_us_per_block"], ".0f"), fmt(r["read_us_per_block"], ".0f"), fmt(r["evict_ms"], ".1f")]
                 for r in rows])
    write_result("bench_disk_io", {"machine": machine(), "rows": rows})
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, key, title in ((axes[0], "write_gbs", "write GB/s"), (axes[1], "read_gbs", "read GB/s")):
            labels = [f"{r['layout']}\n{r['block'].split(' (')[0]}" for r in rows]
            ax.bar(range(len(rows)), [r[key] for r in rows])
            ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=30)
            ax.set_title(title)
        save_plot(fig, "bench_disk_io")
    return rows


if __name__ == "__main__":
    main()
