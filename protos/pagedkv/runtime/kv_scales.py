"""Static fp8 KV scales (``KvScales``): their checks, their file format and their signature.

An ``fp8_e4m3`` pool stores each key element as ``k / k_scale[layer, kv_head]`` rounded to OCP
float8 e4m3fn (saturating at +-448), each value element likewise with ``v_scale``: vLLM's fp8 KV
cache with static scales (``--kv-cache-dtype fp8``), with one scale per KV head instead of one per
layer. The scales are fixed for a pool generation's life, since KV written with one scale reads
wrongly with another. They come from a worker's calibration pass (``SetKvScales``) or from a file
the memory service reads at start (``--kv-scales-file``)::

    {"k_scale": [[s, ...], ...], "v_scale": [[s, ...], ...]}   # [num_layers][num_kv_heads]

``SetKvScales`` carries an HMAC-SHA256 under the pool generation's plane key (the key only the
memory service and the workers mapping the pool hold, :mod:`pagedkv.runtime.grants`), so that only a
worker of the pool can set them, with TLS or without.

Shared by the memory service and the workers.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.runtime.grants import _bytes, _packed, mac

#: Largest finite float8 e4m3fn value.
FP8_MAX = 448.0
_DOMAIN = b"pagedkv.memory.v1.KvScales\x00"


def check_scales(scales: pb.KvScales, num_layers: int, num_kv_heads: int, what: str = "kv scales") -> None:
    """Raise ValueError unless ``scales`` holds ``num_layers * num_kv_heads`` finite, positive
    float32 key and value scales."""
    want = num_layers * num_kv_heads
    for name in ("k_scale", "v_scale"):
        values = getattr(scales, name)
        if len(values) != want:
            raise ValueError(f"{what}: {name} must hold num_layers x num_kv_heads = {num_layers} x {num_kv_heads} = "
                             f"{want} values, got {len(values)}")
        bad = next((v for v in values if not (math.isfinite(v) and v > 0)), None)
        if bad is not None:
            raise ValueError(f"{what}: every {name} must be finite and > 0, got {bad!r}")


def scales_message(pool_generation: int, scales: pb.KvScales) -> bytes:
    """The canonical bytes a ``SetKvScales`` signature covers: the generation, both scale lists
    as float32 little-endian, and the source."""
    parts = [_DOMAIN, struct.pack("<Q", pool_generation)]
    for values in (scales.k_scale, scales.v_scale):
        parts += [struct.pack("<I", len(values)), _packed("f", values)]
    return b"".join([*parts, _bytes(scales.source.encode())])


def sign_scales(key: bytes, pool_generation: int, scales: pb.KvScales) -> bytes:
    """HMAC-SHA256 of ``scales`` for ``pool_generation`` under the plane ``key``."""
    return mac(key, scales_message(pool_generation, scales))


def load_scales_file(path: str | Path, num_layers: int, num_kv_heads: int) -> pb.KvScales:
    """Read a scales file (JSON ``{"k_scale": [[...]], "v_scale": [[...]]}``, [num_layers][num_kv_heads]).

    Raises:
        OSError: the file cannot be read.
        ValueError: not that JSON, or scales of the wrong shape or not finite and > 0.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: must be an object with k_scale and v_scale")
    lists = {}
    for name in ("k_scale", "v_scale"):
        rows = doc.get(name)
        if (not isinstance(rows, list) or len(rows) != num_layers
                or any(not isinstance(r, list) or len(r) != num_kv_heads for r in rows)):
            raise ValueError(f"{path}: {name} must be a [{num_layers}][{num_kv_heads}] list of lists (num_layers x "
                             "num_kv_heads)")
        flat = [v for r in rows for v in r]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in flat):
            raise ValueError(f"{path}: {name} must hold numbers")
        lists[name] = flat
    scales = pb.KvScales(**lists, source=f"file:{path}")
    check_scales(scales, num_layers, num_kv_heads, str(path))
    return scales


def scales_document(scales: pb.KvScales, num_kv_heads: int) -> dict:
    """``scales`` as the file's JSON object (what :func:`load_scales_file` reads back)."""
    def rows(values):
        return [list(values[i : i + num_kv_heads]) for i in range(0, len(values), num_kv_heads)]

    return {"k_scale": rows(scales.k_scale), "v_scale": rows(scales.v_scale)}
