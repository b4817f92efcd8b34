"""Record ids kept compactly, for runs over millions of conversations: the set of `mtp_train.data.ids` (resume:
which records are done; which conversation ids were seen) and a map from record id to its place in the merged output.

The map holds 64-bit hashes of the ids, never the strings: 24 bytes a record, where Python's dict of strings costs
over 100. Two ids share a hash with probability about n^2 / 2^65 (under 3e-8 for a million ids); the merge and the
resume check treat them as one id then.
"""

from __future__ import annotations

from array import array

import numpy as np

from mtp_train.data.ids import id_hash


def record_id(conv_id: str, k: int, n: int) -> str:
    """`<conv id>` for a single sample, `<conv id>#<k>` (k from 0) for one of n > 1."""
    return conv_id if n == 1 else f"{conv_id}#{k}"


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
