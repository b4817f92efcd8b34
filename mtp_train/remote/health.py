"""An endpoint's health as the client sees it: live, failing (one try at a time, after a backoff), or dead.

A failed try (a dropped or refused connection, a timeout, 429, 5xx) starts a failing streak. While it lasts, the
endpoint sends one try at a time (a probe), each after a backoff that doubles per round of failures (at most
`http.MAX_BACKOFF`), and its other workers send nothing: the requests queued behind a failing endpoint go to the
other endpoints instead of each paying the backoff in turn. An answer to a try sent after the streak's last
failure ends the streak. An endpoint that has answered nothing `dead_after` seconds after the streak's first
failure is dead (`expired`), whether a try is in flight or not: nothing more is sent to it for the rest of the run,
and the client hands the requests it still holds to the live endpoints.

Times are `time.monotonic()` seconds passed in by the caller, so the rules are plain functions of what happened
when (and are tested so, without a clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mtp_train.remote.http import backoff_seconds

LIVE = "live"  # send requests freely
PROBE = "probe"  # send the one try that shows whether a failing endpoint is back


@dataclass
class EndpointHealth:
    """What the client knows of one endpoint (module docstring).

    Args:
        url: the endpoint's base URL.
        backoff: seconds before the first probe after a failure (doubled per round of failures).
        dead_after: seconds of failures in a row after which the endpoint is dead.
    """

    url: str
    backoff: float
    dead_after: float
    failing_since: float | None = None  # the streak's first failure; None: live
    rounds: int = 0  # rounds of failures in the streak (a round: the tries sent after its previous failure)
    last_failure: float = -math.inf  # when the last failure came
    next_try: float = -math.inf  # no probe goes before this time
    probing: bool = False  # a probe is in flight
    last_error: str = ""  # the last failure's reason (what the run says when every endpoint is dead)
    dead: bool = False

    def admit(self, now: float) -> str | float | None:
        """What a worker of this endpoint may do at `now`: LIVE or PROBE (send; a PROBE is claimed with
        `start_probe`), seconds to wait before asking again (math.inf: until the probe in flight ends), or None
        (dead: the worker stops)."""
        if self.dead:
            return None
        if self.failing_since is None:
            return LIVE
        if self.probing:
            return math.inf
        return PROBE if now >= self.next_try else self.next_try - now

    def start_probe(self) -> None:
        """A worker sends the probe: the endpoint's other workers wait for its outcome."""
        self.probing = True

    def succeeded(self, sent_at: float) -> None:
        """A try sent at `sent_at` was answered: the endpoint is live again, unless the try left before the last
        failure (an answer started before the server went says nothing of it now). A dead one stays dead: its
        requests went elsewhere."""
        if sent_at < self.last_failure:
            return
        self.failing_since, self.rounds, self.next_try, self.probing = None, 0, -math.inf, False

    def failed(self, now: float, sent_at: float, reason: str, retry_after: float | None = None) -> bool:
        """Record a failed try sent at `sent_at` that failed at `now`; True when the endpoint is dead.

        Tries that were already in flight when the previous failure came (a server that died with `concurrency`
        requests on it) are the same round: they do not lengthen the backoff.
        """
        self.probing = False
        self.last_error = reason
        if self.failing_since is None:
            self.failing_since = now
        if sent_at >= self.last_failure:  # a new round: the backoff doubles from its failure
            self.rounds += 1
            self.next_try = now + backoff_seconds(self.backoff, self.rounds, retry_after)
        elif retry_after:  # the same round, a server asking for a longer pause
            self.next_try = max(self.next_try, now + retry_after)
        self.last_failure = now
        if self.expired(now):
            self.declare_dead()
        return self.dead

    @property
    def deadline(self) -> float | None:
        """When a failing endpoint is dead unless it answers before; None while it is live."""
        return None if self.failing_since is None else self.failing_since + self.dead_after

    def expired(self, now: float) -> bool:
        """Whether a failing endpoint's `dead_after` has run out at `now` (it is not dead yet: `declare_dead`)."""
        deadline = self.deadline
        return not self.dead and deadline is not None and now >= deadline

    def declare_dead(self) -> None:
        """Nothing more goes to this endpoint."""
        self.dead, self.probing = True, False

    def describe(self, now: float) -> str:
        """`url` and why it is not answering, for a one-line message."""
        since = "" if self.failing_since is None else f"failing for {now - self.failing_since:.1f} s, "
        return f"{self.url} ({since}last: {self.last_error or 'no failure'})"
