"""The error a wrong setting raises: it names the key and what to do."""

from __future__ import annotations


class ConfigError(ValueError):
    """A key the schema does not have, or a value out of range; the message names the key and what to do."""
