"""Eviction policies. Each ranks the resident experts of one slot pool; the cache asks for victims."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from .cache import Key


class LRUPolicy:
    """Least recently used: the reactive baseline. A load counts as a use."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def inserted(self, key: Key, staged: bool) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def used(self, key: Key) -> None:
        self._order.move_to_end(key)

    def removed(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Iterable[Key]) -> Key | None:
        allowed = set(candidates)
        for key in self._order:
            if key in allowed:
                return key
        return None


POLICY_CLASSES = {"lru": LRUPolicy}


def make_policy(name: str):
    return POLICY_CLASSES[name]()
