"""The error a wrong setting raises (it names the key and what to do), and the stop a stage reports on SIGINT."""

from __future__ import annotations


class ConfigError(ValueError):
    """A key the schema does not have, or a value out of range; the message names the key and what to do."""


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) caught by a stage that knows where it stopped: the message says where, and that a re-run of
    the same command goes on from there. A KeyboardInterrupt still, so nothing that catches Exception stops it."""
