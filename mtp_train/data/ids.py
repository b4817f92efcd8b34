"""Ids held compactly, for runs over millions of conversations: a set of their 64-bit hashes, never the strings.

A set costs 16 to 32 bytes an id where Python's set of strings costs over 100. Two ids share a hash with probability
about n^2 / 2^65 (under 3e-8 for a million ids); they are taken as one id then. Stage one's duplicate-id rule
(`data.samples`) and regeneration's resume and merge (`regenerate`) both keep their ids here.
"""

from __future__ import annotations

import hashlib
from array import array


def id_hash(rid: str) -> int:
    """A 64-bit hash of an id, never 0 (the empty slot of `IdSet`)."""
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little") or 1


class IdSet:
    """A set of ids as their hashes in an open-addressing table (linear probing, at most half full).

    Args:
        capacity: slots to start with (rounded up to a power of two); the table doubles as it fills.
    """

    def __init__(self, capacity: int = 1024) -> None:
        size = 1
        while size < max(capacity, 8):
            size *= 2
        self._table = array("Q", bytes(8 * size))
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _slot(self, h: int) -> int:
        """Where `h` sits, or the empty slot where it would go."""
        table, mask = self._table, len(self._table) - 1
        i = h & mask
        while table[i] and table[i] != h:
            i = (i + 1) & mask
        return i

    def add(self, rid: str) -> bool:
        """Add `rid`; True when it was not in the set."""
        h = id_hash(rid)
        i = self._slot(h)
        if self._table[i]:
            return False
        self._table[i] = h
        self._count += 1
        if 2 * self._count > len(self._table):
            self._grow()
        return True

    def __contains__(self, rid: object) -> bool:
        return isinstance(rid, str) and bool(self._table[self._slot(id_hash(rid))])

    def _grow(self) -> None:
        old = self._table
        self._table = array("Q", bytes(16 * len(old)))
        for h in old:
            if h:
                self._table[self._slot(h)] = h
