"""A read-only mapping of live entries by id, changed only by the class that owns it.

The lease table and the sequence table both expose their live entries this way
(``key in table``, ``table[key]``, ``len(table)``, iteration in creation order)
while keeping creation and removal to their own methods.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LiveTable(Mapping[K, V]):
    """Live entries by key; subclasses add and remove entries in ``_live``."""

    def __init__(self) -> None:
        self._live: dict[K, V] = {}

    def __getitem__(self, key: K) -> V:
        return self._live[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)
