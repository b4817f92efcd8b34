"""One registry helper for every swappable part: head types, target families, data sources, loss kinds, eval
methods and export layouts.

A `Registry` maps names to entries. Names are checked when registered (a lower-case identifier with `-`, `.` or
`_`, never registered twice) and an unknown name is answered with the known ones, the same way everywhere.

One way to fill one: an entry is added where it is defined, `REGISTRY.add(entry)` (a decorator for a class), under
its own name (its `key` attribute). A registry whose entries live in other modules names them with `package`: on
its first read it imports that module by computed name, and when it is a package, every module and sub-package
directly in it (sorted by name), so that the registry is complete whenever it is read and a new plug-in module is
found without being listed anywhere or imported by hand. A plug-in either adds its entries itself (data sources,
loss kinds) or defines them as a module-level `attr` the scan adds (`FAMILY = Family(...)`, `HEAD_TYPE = ...`,
under the module's name); `group` adds the entries another installed package declares as entry points.

A registry on the settings floor whose entries are defined above it (the loss kinds, the data sources) is
declared here, on the floor, and filled by its `package` on the first read: the settings check names against it
while this floor imports nothing of the project at import time (neither the project nor torch nor Hydra).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_NAME = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")


class RegistryError(ValueError):
    """An unknown name, a duplicate or a malformed one (a ValueError, so config checks report it as such)."""


class Registry(Generic[T]):
    """Names → entries of one kind (`kind` names it in messages: "head type", "loss kind", ...).

    Args:
        kind: what an entry is, for messages.
        package: the dotted name of the module that fills the registry, imported on the first read; a package is
            scanned (its modules and sub-packages, by name). None = every entry is added where the registry is.
        attr: the module-level name under which a scanned plug-in defines its entry, which the scan adds under
            the module's name (the entry's own name must equal it); None = the modules add their entries themselves.
        packages_only: scan only the sub-packages (the modules beside them are parts several plug-ins share).
        optional: a scanned module without `attr` is skipped; else it is refused (every module is a plug-in).
        group: an entry-point group whose entries (objects named by another installed package) are added too.
        entry_type: the class every entry the scan finds must be an instance of (None: not checked).
        on_add: called with every entry before it is registered (an index of the registry, a cross-entry check:
            raising refuses the entry).
        key: the attribute of an entry that holds its name, for `add(entry)`; None = entries are named by `register`.
        discover: a callable doing the discovery instead of `package` (kept for a registry not yet declared with
            `package`); not with `package`.
    """

    def __init__(self, kind: str, package: str | None = None, *, attr: str | None = None,
                 packages_only: bool = False, optional: bool = False, group: str | None = None,
                 entry_type: type | None = None, on_add: Callable[[T], None] | None = None,
                 key: str | None = "name", discover: Callable[[], None] | None = None) -> None:
        if package is not None and discover is not None:
            raise TypeError(f"the {kind} registry takes a package to scan or a discover callable, not both")
        if package is None and (attr or packages_only or group):
            raise TypeError(f"the {kind} registry scans nothing: attr, packages_only and group need a package")
        self.kind = kind
        self.package, self.attr, self.group = package, attr, group
        self.packages_only, self.optional, self.entry_type = packages_only, optional, entry_type
        self._entries: dict[str, T] = {}
        self._discover = discover if discover is not None else (self._scan if package is not None else None)
        self._discovering = False
        self._on_add = on_add
        self._key = key

    # -- discovery --

    def _scan(self) -> None:
        """Import `package` (and, a package, each module / sub-package in it) by computed name; add the `attr` of
        each and the entry points of `group`. Imported here, at the first read: this floor imports nothing of the
        project at import time, and the plug-ins may live on any floor above it."""
        import importlib
        import pkgutil

        assert self.package is not None
        root = importlib.import_module(self.package)
        if hasattr(root, "__path__"):  # a package: every module in it is a plug-in (or fills the registry)
            for info in sorted(pkgutil.iter_modules(root.__path__), key=lambda m: m.name):
                if self.packages_only and not info.ispkg:
                    continue
                module = importlib.import_module(f"{self.package}.{info.name}")
                if self.attr is None:
                    continue  # the module added its entries itself, where it defines them
                if not hasattr(module, self.attr):
                    if self.optional:
                        continue
                    raise TypeError(f"{module.__name__} defines no {self.attr}; every module of {self.package} is a "
                                    f"{self.kind} plug-in (define {self.attr} in it, or move it out of the package)")
                self._add_found(getattr(module, self.attr), f"{module.__name__}.{self.attr}", info.name)
        if self.group is not None:
            from importlib import metadata

            for ep in sorted(metadata.entry_points(group=self.group), key=lambda ep: ep.name):
                self._add_found(ep.load(), f"entry point {ep.name} = {ep.value} ({self.group})", ep.name)

    def rescan(self) -> None:
        """Scan the package again after the first read, adding the plug-ins that appeared since (a head-type folder
        put on the package's path at run time); entries found before stay as they are."""
        if self.package is None:
            raise TypeError(f"the {self.kind} registry scans no package")
        if self._discover is not None:  # never read yet: the first read's scan finds everything there is
            self._load()
        else:
            self._scan()

    def _add_found(self, entry: Any, where: str, name: str) -> None:
        """Add a plug-in's entry, which must be named as its module (or entry point) is."""
        if (self.entry_type is not None and not isinstance(entry, self.entry_type)) or (
                self._key is not None and getattr(entry, self._key, None) != name):
            what = self.entry_type.__name__ if self.entry_type is not None else self.kind
            raise TypeError(f"{where} is not a {what} named {name!r}")
        if self._entries.get(name) is not entry:  # an installed copy and a source tree may both name it
            self.register(name, entry)

    # -- writing --

    def register(self, name: str, entry: T) -> T:
        """Add `entry` under `name`; a malformed name or one registered already is refused. Returns `entry`."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise RegistryError(f"{self.kind} name {name!r} is not a lower-case name of letters, digits, '-', '.' "
                                "or '_'")
        if name in self._entries:
            raise RegistryError(f"{self.kind} {name!r} is registered twice")
        if self._on_add is not None:
            self._on_add(entry)
        self._entries[name] = entry
        return entry

    def add(self, entry: T) -> T:
        """Register `entry` under its own name (the `key` attribute), where it is defined. Returns `entry`, so it is
        usable as a class decorator (`@DATA_SOURCES.add`) and in an assignment (`X = REGISTRY.add(Entry(...))`)."""
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
