"""Head types as plug-ins: one module of this package per head type, each defining `HEAD_TYPE = HeadType(...)`.

A `HeadType` (`mtp_train.config.head`) bundles everything that differs between head types: its settings spec,
its module class (whose `unroll` is its training unroll), its inference drafter (a proposer factory: a chain, a
tree, or any other `DraftTree` maker), its validation path and the eval options its drafter takes; its export
formats are named by the spec and their layouts registered in `mtp_train.export`. Everything else asks the
registry `mtp_train.config.head.HEAD_TYPES`, which imports this package on its first read; importing it registers
every module here that defines `HEAD_TYPE` (modules without one, like `chain.py`, are parts several types share).

Adding a head type: a module here (its `DraftHead` subclass, or one from `mtp_train.heads`, and its `HEAD_TYPE`),
its conf group `conf/head/<name>.yaml`, its docs and its tests. Nothing else names it.
"""

from __future__ import annotations

import importlib
import pkgutil

from mtp_train.config.head import HEAD_TYPES, HeadType


def _register_all() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        entry = getattr(module, "HEAD_TYPE", None)
        if entry is None:
            continue  # a part several head types share
        if not isinstance(entry, HeadType):
            raise TypeError(f"{module.__name__}.HEAD_TYPE is a {type(entry).__name__}, not a HeadType")
        HEAD_TYPES.add(entry)


_register_all()
