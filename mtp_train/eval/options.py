"""The grid of an evaluation, expanded once: one `EvalPoint` per run, each labelled by the axes that vary.

`expand_grid(cfg)` multiplies, per method of the evaluation (`mtp_train.eval.methods.grid_methods`), only the axes
the method owns (`MethodSpec.grid_axes`): `none` gets one point per temperature whatever k is, prompt lookup one per
(k, temperature), the head one per k, temperature and each option its head type's drafter takes (a chain head's
threshold, catch-up, width and tree; a block head's threshold and tree), a tree's points at k = its steps only (the
head method's rule). A point's `label` names its method and every axis that takes more than one value in the grid
(`head k=3 tree=3x4x8`), so two runs of one grid never share a label; report rows, plot series and the console all
use it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from mtp_train.config import EvalConfig
from mtp_train.eval.methods import MethodSpec, grid_methods, method_spec

PLOT_X = "k"  # the x axis of the τ / speed-up plot: a series is a label without it


@dataclass(frozen=True)
class EvalPoint:
    """One run of the grid: a method, k (0 for plain decoding, as its rows have always said), the temperature and
    the values of the method's own other axes (`opts`, in its axes' order)."""

    method: str
    k: int = 0
    temperature: float = 0.0
    opts: tuple[tuple[str, Any], ...] = ()  # (axis, value) of the method's axes other than k and temperature
    varies: frozenset[str] = field(default=frozenset(), compare=False)  # the grid's axes with more than one value

    @classmethod
    def of(cls, method: str, k: int = 0, temperature: float = 0.0, varies: frozenset[str] = frozenset(),
           **options: Any) -> EvalPoint:
        """A point from keyword options, e.g. `EvalPoint.of("head", k=2, draft_width=2, ...)`."""
        return cls(method, k, temperature, tuple(options.items()), varies)

    @property
    def spec(self) -> MethodSpec:
        return method_spec(self.method)

    @property
    def options(self) -> dict[str, Any]:
        """The method's own settings beyond k and temperature, e.g. {"draft_threshold": 0.0, "catch_up": "target",
        "draft_width": 2, "tree": "none"} for a chain head under `head` (what its proposer is built with, and
        columns of its rows); {} for the methods without other axes."""
        return dict(self.opts)

    def value(self, axis: str) -> Any:
        """The point's value on `axis` (k, temperature or one of its options); None where the axis is not its own."""
        if axis in ("k", "temperature"):
            return getattr(self, axis)
        return self.options.get(axis)

    def label_without(self, *axes: str) -> str:
        """The label leaving out `axes` (e.g. the plot's x axis)."""
        parts = [self.spec.display]
        parts += [a.label.format(self.value(a.name)) for a in self.spec.axes
                  if a.name in self.varies and a.name not in axes]
        return " ".join(parts)

    @property
    def label(self) -> str:
        """The method's display name and every axis of it that varies in the grid: `head k=2 width=2`."""
        return self.label_without()

    @property
    def series(self) -> str:
        """The label without k: the line this point lies on in the τ / speed-up vs k plot."""
        return self.label_without(PLOT_X)

    def row_fields(self) -> dict[str, Any]:
        """The keys every report row of this point starts with (method, k, temperature, options, label, series)."""
        return {"method": self.method, "k": self.k, "temperature": self.temperature, **self.options,
                "label": self.label, "series": self.series}


def expand_grid(cfg: EvalConfig) -> list[EvalPoint]:
    """Every run of `cfg`'s grid (unknown method or bad axis values refused here, before anything loads): the
    plain baseline per temperature first, then per method its own axes multiplied, k innermost, each point as the
    method's rule leaves it (a tree at k = its steps), once."""
    values: list[tuple[MethodSpec, tuple[str, ...], dict[str, Any]]] = []
    for spec in grid_methods(cfg):
        owned = tuple(a.name for a in spec.grid_axes(cfg))  # the head's: its drafter's options, k and temperature
        axes = [a for a in owned if a != "k"] + [a for a in owned if a == "k"]  # k innermost
        for combo in itertools.product(*(cfg.grid(a) for a in axes)):
            v = spec.rule(dict(zip(axes, combo)))
            if (spec, owned, v) not in values:
                values.append((spec, owned, v))
    names = {a for _, owned, _ in values for a in owned}
    varies = frozenset(a for a in names if len({v[a] for _, _, v in values if a in v}) > 1)
    points = []
    for spec, owned, v in values:
        opts = tuple((a, v[a]) for a in owned if a not in ("k", "temperature"))
        points.append(EvalPoint(spec.name, v.get("k", 0), v.get("temperature", 0.0), opts, varies))
    return points
