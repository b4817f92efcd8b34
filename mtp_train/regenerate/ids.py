"""Record ids kept compactly, for runs over millions of conversations: a set (resume: which records are done; which
conversation ids were seen) and a map from record id to its place in the merged output.

Both hold 64-bit hashes of the ids, never the strings: a set costs 16 to 32 bytes an id, the order 24 bytes a record,
where Python's set and dict of strings cost over 100. Two ids share a hash with probability about n^2 / 2^65 (under
3e-8 for a million ids); the merge and the resume check treat them as one id then.
"""

from __future__ import annotations

import hashlib
from array import array

import numpy as np


def record_id(conv_id: str, k: int, n: int) -> str:
    """`<conv id>` for a single sample, `<conv id>#<k>` (k from 0) for one of n > 1."""
    return conv_id if n == 1 else f"{conv_id}#{k}"


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


class RecordOrder:
    """Record id → (conversation position, sample index): the order of the merged output, built as conversations
    are read (`add`) and looked up by the merge (`get`, as a mapping's).

    Args:
        n: samples (records) per conversation.
    """

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self._hashes = array("Q")
        self._pos = array("q")
        self._k = array("q")
        self._sorted: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, conv_id: str, position: int) -> None:
        """The records of a conversation first met at `position` (the caller skips repeated ids)."""
        for k in range(self.n):
            self._hashes.append(id_hash(record_id(conv_id, k, self.n)))
            self._pos.append(position)
            self._k.append(k)
        self._sorted = None

    def get(self, rid: str, default: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """(position, sample index) of record `rid`, or `default` when no conversation read has it (the first
        conversation wins where two records share an id)."""
        if self._sorted is None:
            hashes = np.frombuffer(self._hashes, dtype=np.uint64) if self._hashes else np.zeros(0, np.uint64)
            by = np.argsort(hashes, kind="stable")  # stable: the earliest position first among equal hashes
            self._sorted = (hashes[by], np.asarray(self._pos, dtype=np.int64)[by], np.asarray(self._k,
                                                                                              dtype=np.int64)[by])
        hashes, pos, k = self._sorted
        h = np.uint64(id_hash(rid))
        i = int(np.searchsorted(hashes, h))
        if i == len(hashes) or hashes[i] != h:
            return default
        return int(pos[i]), int(k[i])
