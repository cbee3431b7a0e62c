"""Typed reads of a model's JSON config files, each failure a ValueError naming the file and key.

config.json and generation_config.json come from whoever published a model: a key may be
missing, null, or of the wrong JSON type. Every read here checks the type it needs (a bool is not
a number, 4096.0 is an integer, 24.5 is not), so a bad file is refused at start with one line that
says where, never a traceback and never a silent coercion.
"""

from __future__ import annotations

import math
from pathlib import Path

#: The largest token id a proto int32 carries.
MAX_TOKEN_ID = 2**31 - 1
_MISSING = object()


class ConfigFile:
    """One JSON object read from ``path`` (config.json, generation_config.json).

    Raises ValueError when the document is not a JSON object.
    """

    def __init__(self, data, path: Path | str) -> None:
        self.path = str(path)
        if not isinstance(data, dict):
            raise ValueError(f"{self.path}: expected a JSON object, got {type(data).__name__}")
        self.data = data

    def _get(self, key: str, default):
        v = self.data.get(key, _MISSING)
        if v is _MISSING or (v is None and default is not _MISSING):
            if default is _MISSING:
                raise ValueError(f"{self.path}: {key} is missing")
            return default
        return v

    def error(self, key: str, want: str, value) -> ValueError:
        return ValueError(f"{self.path}: {key} must be {want}, got {value!r}"[:300])

    def int(self, key: str, default=_MISSING, *, minimum: int | None = 1) -> int:
        """An integer (an integral float such as 4096.0 too), >= ``minimum`` when given."""
        v = self._get(key, default)
        if not is_integer(v) or (minimum is not None and v < minimum):
            raise self.error(key, "an integer" + (f" >= {minimum}" if minimum is not None else ""), v)
        return int(v)

    def float(self, key: str, default=_MISSING, *, positive: bool = False) -> float:
        """A finite number (> 0 with ``positive``)."""
        v = self._get(key, default)
        if not is_number(v) or not math.isfinite(v) or (positive and not v > 0):
            raise self.error(key, "a finite number" + (" > 0" if positive else ""), v)
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise self.error(key, "true or false", v)
        return v

    def str(self, key: str, default: str) -> str:
        v = self._get(key, default)
        if not isinstance(v, str):
            raise self.error(key, "a string", v)
        return v

    def object(self, key: str) -> dict | None:
        """A nested JSON object, or None when absent or null."""
        v = self._get(key, None)
        if v is not None and not isinstance(v, dict):
            raise self.error(key, "a JSON object", v)
        return v

    def names(self, key: str) -> list[str]:
        """A list of strings (``architectures``); [] when absent or null."""
        v = self._get(key, [])
        if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
            raise self.error(key, "a list of names", v)
        return v

    def token_ids(self, key: str) -> list[int]:
        """A token id or a list of them (``eos_token_id``), each in [0, 2**31); [] when absent."""
        v = self._get(key, [])
        ids = v if isinstance(v, list) else [v]
        if not all(is_integer(t) and 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise self.error(key, f"a token id or a list of token ids in [0, {MAX_TOKEN_ID}]", v)
        return [int(t) for t in ids]


def is_number(v) -> bool:
    """A JSON number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_integer(v) -> bool:
    """A JSON integer, or a float with an integral value."""
    return is_number(v) and (isinstance(v, int) or (math.isfinite(v) and float(v).is_integer()))
