"""The grid of an evaluation, expanded once: one `EvalPoint` per run, each labelled by the axes that vary.

`expand_grid(cfg)` multiplies, per method of the evaluation (`mtp_train.eval.methods.grid_methods`), only the axes
that apply to it: `none` gets one point per temperature whatever k is, prompt lookup one per (k, temperature), the
head one per (k, threshold, catch-up, width, tree, temperature), a tree's points at k = its steps only. A point's
`label` names its method and every axis that takes more than one value in the grid (`mtp head k=3 tree=3x4x8`), so
two runs of one grid never share a label; report rows, plot series and the console all use it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from mtp_train.config import GRID_AXES, EvalConfig
from mtp_train.eval.methods import MethodSpec, grid_methods, method_spec

# How a label shows each axis, in GRID_AXES order.
AXIS_FORMATS = {"k": "k={}", "draft_threshold": "thr={:g}", "catch_up": "catch-up={}", "draft_width": "width={}",
                "tree": "tree={}", "temperature": "T={:g}"}
PLOT_X = "k"  # the x axis of the τ / speed-up plot: a series is a label without it


@dataclass(frozen=True)
class EvalPoint:
    """One run of the grid: a method and the value of each axis that applies to it (None where it does not; k is
    0 for plain decoding, as its rows have always said)."""

    method: str
    k: int = 0
    temperature: float = 0.0
    draft_threshold: float | None = None
    catch_up: str | None = None
    draft_width: int | None = None
    tree: str | None = None  # mtp: "none" (a chain, or draft_width's tree) or a dynamic tree STEPSxTOPKxTOKENS
    varies: frozenset[str] = field(default=frozenset(), compare=False)  # the grid's axes with more than one value

    @property
    def spec(self) -> MethodSpec:
        return method_spec(self.method)

    @property
    def options(self) -> dict[str, Any]:
        """The method's own settings beyond k and temperature, e.g. {"draft_threshold": 0.0, "catch_up": "target",
        "draft_width": 2} for `mtp` (what its proposer is built with, and columns of its rows); {} for the others."""
        return {a: getattr(self, a) for a in self.spec.axes if a not in ("k", "temperature")}

    def label_without(self, *axes: str) -> str:
        """The label leaving out `axes` (e.g. the plot's x axis)."""
        parts = [self.spec.display]
        parts += [AXIS_FORMATS[a].format(getattr(self, a)) for a in GRID_AXES
                  if a in self.varies and a in self.spec.axes and a not in axes]
        return " ".join(parts)

    @property
    def label(self) -> str:
        """The method's display name and every axis of it that varies in the grid: `mtp head k=2 width=2`."""
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
    plain baseline per temperature first, then per method its own axes multiplied, k innermost."""
    values: list[tuple[MethodSpec, dict[str, Any]]] = []
    for spec in grid_methods(cfg):
        axes = [a for a in GRID_AXES if a in spec.axes]
        axes = [a for a in axes if a != "k"] + [a for a in axes if a == "k"]  # k innermost: a series runs together
        for combo in itertools.product(*(cfg.grid(a) for a in axes)):
            v = dict(zip(axes, combo))
            if v.get("tree", "none") != "none":  # a tree drafts its own depth: one point per tree, at k = steps
                v["k"] = int(v["tree"].split("x")[0])
                if "draft_width" in v:  # the tree sets its own widths: one point, not one per draft_width
                    v["draft_width"] = 1
                if (spec, v) in values:
                    continue
            values.append((spec, v))
    varies = frozenset(a for a in GRID_AXES if len({v[a] for _, v in values if a in v}) > 1)
    return [EvalPoint(spec.name, varies=varies, **v) for spec, v in values]
