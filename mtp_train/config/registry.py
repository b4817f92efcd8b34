"""One registry helper for every swappable part: head types, data sources, loss kinds, eval methods, export layouts
and target families.

A `Registry` maps names to entries. Names are checked when registered (a lower-case identifier with `-`, `.` or
`_`, never registered twice) and an unknown name is answered with the known ones, the same way everywhere. A
registry whose entries live in plug-in modules (one module per head type or per family) takes a `discover`
callable that imports them on the first look-up, so that the registry is complete whenever it is read and a
plug-in is found without being imported by hand.

It imports nothing, like the rest of the config floor (neither the project nor torch nor Hydra).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_NAME = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")


class RegistryError(ValueError):
    """An unknown name, a duplicate or a malformed one (a ValueError, so config checks report it as such)."""


class Registry(Generic[T]):
    """Names → entries of one kind (`kind` names it in messages: "head type", "loss kind", ...).

    Args:
        kind: what an entry is, for messages.
        discover: called once, before the first read, to import the modules that register the entries (plug-ins
            found by scanning a package); None when every entry is registered where the registry is defined.
        key: the attribute of an entry that holds its name, for `add(entry)`; None = entries are named by `register`.
    """

    def __init__(self, kind: str, discover: Callable[[], None] | None = None, key: str | None = "name") -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._discover = discover
        self._discovering = False
        self._key = key

    # -- writing --

    def register(self, name: str, entry: T) -> T:
        """Add `entry` under `name`; a malformed name or one registered already is refused. Returns `entry`."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise RegistryError(f"{self.kind} name {name!r} is not a lower-case name of letters, digits, '-', '.' "
                                "or '_'")
        if name in self._entries:
            raise RegistryError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def add(self, entry: T) -> T:
        """Register `entry` under its own name (the `key` attribute). Returns `entry` (usable as a decorator)."""
        if self._key is None:
            raise TypeError(f"the {self.kind} registry names its entries explicitly: use register(name, entry)")
        return self.register(getattr(entry, self._key), entry)

    def registered(self, name: str) -> T | None:
        """The entry `name` as registered so far, without discovering (None when there is none yet)."""
        return self._entries.get(name)

    def unregister(self, name: str) -> T:
        """Remove and return the entry `name` (a plug-in registered for a while, e.g. by a test)."""
        self._load()
        if name not in self._entries:
            raise self._unknown(name)
        return self._entries.pop(name)

    # -- reading --

    def _load(self) -> None:
        if self._discover is not None and not self._discovering:
            discover, self._discovering = self._discover, True
            try:
                discover()
            except BaseException:
                self._discovering = False  # a failed discovery is retried (and raises again) on the next read
                raise
            self._discover = None

    def _unknown(self, name: object) -> RegistryError:
        known = ", ".join(self._entries) or "none registered"
        return RegistryError(f"unknown {self.kind} {name!r}; choose one of {known}")

    def get(self, name: str) -> T:
        """The entry `name`; a RegistryError naming the known entries otherwise."""
        self._load()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise self._unknown(name) from None

    __getitem__ = get

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        self._load()
        return tuple(self._entries)

    def items(self) -> list[tuple[str, T]]:
        self._load()
        return list(self._entries.items())

    def values(self) -> list[T]:
        self._load()
        return list(self._entries.values())

    def keys(self) -> tuple[str, ...]:
        return self.names()

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"
