"""Head types as plug-ins: one module of this package per head type, each defining `HEAD_TYPE = HeadType(...)`.

A `HeadType` (`mtp_train.config.head`) bundles everything that differs between head types: its settings spec,
its module class (whose `unroll` is its training unroll), its inference drafter (a proposer factory: a chain, a
tree, or any other `DraftTree` maker), its validation path and the eval options its drafter takes; its export
formats are named by the spec and their layouts registered in `mtp_train.export`. Everything else asks the
registry `mtp_train.config.head.HEAD_TYPES`, which loads each module named by an entry point of the group
`mtp_train.head_types` (pyproject.toml) on its first read. Modules without a `HEAD_TYPE`, like `chain.py`, are
parts several types share.

Adding a head type: a module here (its `DraftHead` subclass, or one from `mtp_train.heads`, and its `HEAD_TYPE`),
its entry point, its conf group `conf/head/<name>.yaml`, its docs and its tests. A package of one's own can ship
a head type the same way, with an entry point of that group.
"""
