"""Captures for training straight from a fleet (`data.source=fleet`): requests kept in flight over running servers
while the spool folder stays under a byte cap.

The trainer hands `FleetDriver` the captures it will need in the order it will consume them (an iterator of
`Wanted`: its batch plan). A thread (`EndpointCapture.serve`, with its endpoint health, retries and dead-endpoint
handling) sends them a part at a time, at most `window` requests, each as soon as the spool has room for its worst
case (`spool.capture_bound`: prompt tokens × bytes per token of the captured layers, plus the header). So at any
moment

    used = Σ worst cases of the requests sent whose files have not been seen yet
         + Σ sizes of this run's capture files seen on disk (until `drop`)
         + the sizes of other files found in the folder at start                  ≤  cap,

and `used` bounds the bytes in the folder: a file is written to a temporary sibling and renamed, so a request never
holds more than its file's size. A capture counts from its request's sending until the trainer drops it (after a
checkpoint covers it, or at once for an evaluation's); once seen, its worst case is lowered to its size. `keep`
bytes are held back from the plan's requests for `urgent` ones (an evaluation's samples, asked for when needed),
so that an evaluation never waits for room that only training could free.

Imports our package (it runs in the trainer, not in vLLM's processes).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mtp_train.capture.endpoints import EndpointCapture
from mtp_train.capture.launch import CaptureError
from mtp_train.capture.spool import file_name, torn_of
from mtp_train.data.samples import Row

POLL_S = 0.05  # how often a wait for a capture file looks again (it is also woken by the driver)


@dataclass
class Wanted:
    """One capture to ask for: its name (the request's sample id), the row it prefills, its file's worst case."""

    name: str
    row: Row
    bound: int


class FleetDriver:
    """Sends the requests of a plan as the spool's room allows, and tells the trainer when their files are there.

    Args:
        capture: the endpoints' client (`EndpointCapture.connect`), already probed.
        cap: the most bytes the spool may hold (`data.fleet.max_spool_bytes`).
        window: the most requests sent at once.
        keep: bytes the plan's requests leave free for `urgent` ones.
    """

    def __init__(self, capture: EndpointCapture, cap: int, *, window: int, keep: int = 0) -> None:
        self.capture, self.spool = capture, capture.spool
        self.cap, self.window, self.keep = int(cap), max(int(window), 1), int(keep)
        self.used = 0  # bytes counted now (module docstring)
        self.peak = 0  # the most `used` has been
        self.sent = 0  # requests sent
        self.held: dict[str, int] = {}  # capture name → bytes counted for it
        self.seen: set[str] = set()  # captures whose file has been seen (counted at its size)
        self.blocked = False  # the plan's next request waits for room while nothing is in flight
        self._plan: Iterator[Wanted] = iter(())
        self._next: Wanted | None = None  # the plan's next request, taken from the iterator but not sent
        self._urgent: collections.deque[Wanted] = collections.deque()
        self._cond = threading.Condition()

    # -- accounting (any thread) --

    def _count(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def fixed(self, nbytes: int) -> None:
        """Count bytes that stay for the whole run (other files found in the folder)."""
        with self._cond:
            self._count(int(nbytes))

    def adopt(self, name: str, size: int) -> None:
        """Count a capture of this run found on disk at start (a resumed run's): it is used, not asked for again."""
        with self._cond:
            self.held[name] = int(size)
            self.seen.add(name)
            self._count(int(size))

    def has_room(self, nbytes: int) -> bool:
        """Whether `nbytes` more would fit now (the probe's check)."""
        with self._cond:
            return self.used + nbytes <= self.cap

    # -- the sending thread --

    def start(self, plan: Iterator[Wanted]) -> None:
        """Send the requests of `plan` (module docstring) from the client's thread."""
        self._plan = plan
        self.capture.serve(self._feed)

    def _peek(self) -> Wanted | None:
        if self._next is None:
            self._next = next(self._plan, None)
        return self._next

    def _take(self, w: Wanted) -> tuple[str, Row]:
        self.held[w.name] = w.bound
        self._count(w.bound)
        self.sent += 1
        return w.name, w.row

    def _feed(self) -> list[tuple[str, Row]] | None:
        """The next part to send (runs in the sending thread; nothing of ours is in flight when it is called): the
        urgent requests first, else the plan's next ones that fit; waits while none fits; None once stopped."""
        with self._cond:
            while not self.capture.stopped:
                part: list[tuple[str, Row]] = []
                while self._urgent and len(part) < self.window and self.used + self._urgent[0].bound <= self.cap:
                    w = self._urgent.popleft()
                    if w.name not in self.held:
                        part.append(self._take(w))
                while not self._urgent and len(part) < self.window:
                    w = self._peek()
                    if w is None:
                        break
                    if w.name in self.held:  # found on disk at start
                        self._next = None
                        continue
                    if self.used + w.bound + self.keep > self.cap:
                        break
                    self._next = None
                    part.append(self._take(w))
                self.blocked = not part and not self._urgent and self._peek() is not None
                self._cond.notify_all()
                if part:
                    return part
                self._cond.wait(0.5)  # woken by `drop`, `urgent` and `stop`
        return None

    # -- the trainer's side --

    def path(self, name: str) -> Path:
        """Where the capture `name` lands."""
        return self.spool / file_name(name)

    def urgent(self, wanted: Iterable[Wanted]) -> None:
        """Ask for these captures before the plan's next ones (an evaluation's)."""
        with self._cond:
            self._urgent.extend(wanted)
            self.blocked = False
            self._cond.notify_all()

    def wait_for(self, name: str) -> Path:
        """The path of capture `name` once its file is there (whole: files are renamed into place), counted at its
        size. CaptureError when it cannot come: the sending failed (no endpoint left, a refused answer), its request
        was answered `capture_timeout` seconds ago without it, or it waits for room that nothing will free (the
        spool is full of captures a checkpoint has not covered yet)."""
        path = self.path(name)
        while not path.is_file():
            with self._cond:
                if self.blocked and name not in self.held:
                    raise CaptureError(
                        f"the spool is full ({self.used} of data.fleet.max_spool_bytes={self.cap} bytes) of captures "
                        f"that wait for a checkpoint, and capture {name!r} waits for room: raise "
                        "data.fleet.max_spool_bytes or lower train.save_every (a capture is deleted once a checkpoint "
                        "covers it)")
            self.capture.check(name, path)
            with self._cond:
                self._cond.wait(POLL_S)
        with self._cond:
            if name in self.held and name not in self.seen:
                size = path.stat().st_size
                self._count(size - self.held[name])
                self.held[name] = size
                self.seen.add(name)
        return path

    def drop(self, names: Iterable[str]) -> None:
        """Delete these captures (and any temporary of theirs a killed writer left) and free their room."""
        for name in names:
            self.path(name).unlink(missing_ok=True)
            for tmp in torn_of(self.spool, name):
                tmp.unlink(missing_ok=True)
            with self._cond:
                self.used -= self.held.pop(name, 0)
                self.seen.discard(name)
                self.blocked = False  # room changed: the sending thread looks again before anyone calls it stuck
                self._cond.notify_all()

    def stop(self, seconds: float) -> None:
        """Send nothing more; wait at most `seconds` for the part in flight to be answered."""
        self.capture.stop()
        with self._cond:
            self._cond.notify_all()
        self.capture.join(seconds)
