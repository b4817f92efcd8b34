"""The methods `mtp-eval` can run, one registered spec each: plain decoding (`none`), a trained head of any type
(`head`; `mtp`, its old name, is an alias `EvalConfig` rewrites), a small draft model (`draft`) and prompt lookup
(`ngram`).

A spec owns the grid axes that apply to the method (`Axis`: an `mtp-eval` key of `GRID_AXES` and how labels show it;
temperature applies to all), how to load what all its proposers share (the head, the draft model) and how to build a
fresh proposer from that and one grid point's options. The head's axes are its head type's drafter's
(`HeadType.draft_options`, read from `head_ckpt`'s config.json before anything loads). A new method is one
`METHODS.add(MethodSpec(...))`; the grid (`mtp_train.eval.options.expand_grid`), the runs and the report take it
from here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from mtp_train.config import GRID_AXES, EvalConfig
from mtp_train.config.head import head_type
from mtp_train.config.registry import Registry
from mtp_train.data.chat import load_tokenizer, tokenizer_fingerprint
from mtp_train.models.base import CausalLM
from mtp_train.models.config import ModelConfigError
from mtp_train.speculative.proposers import DraftModelProposer, NgramProposer, Proposer

log = logging.getLogger(__name__)

# What a method loads once per evaluation: (config, target, tokenizer, target folder) → what its proposers share.
Loader = Callable[[EvalConfig, CausalLM, Any, Path], Any]
# A fresh proposer (each engine owns its proposer's state): (what the loader gave, the point's options, config).
Builder = Callable[[Any, Mapping[str, Any], EvalConfig], Proposer]


def _load_nothing(cfg: EvalConfig, target: CausalLM, tokenizer: Any, target_dir: Path) -> None:
    return None


@dataclass(frozen=True)
class Axis:
    """A grid axis a method owns: the `mtp-eval` key whose value or list it takes (`GRID_AXES`), and how a label
    shows one value of it."""

    name: str
    label: str  # a format of the value, e.g. "thr={:g}"

    def __post_init__(self) -> None:
        if self.name not in GRID_AXES:
            raise ValueError(f"grid axis {self.name!r} is not an mtp-eval key of GRID_AXES ({', '.join(GRID_AXES)})")


K = Axis("k", "k={}")  # every drafter's
TEMPERATURE = Axis("temperature", "T={:g}")  # every method's, the baseline's too
# How a label shows a value of each drafter option (`HeadType.draft_options`); an option not named here shows as
# `name=value`.
OPTION_LABELS = {"draft_threshold": "thr={:g}", "catch_up": "catch-up={}", "draft_width": "width={}", "tree": "tree={}"}
DRAFT_OPTIONS = tuple(a for a in GRID_AXES if a not in (K.name, TEMPERATURE.name))  # every option a drafter may take


def option_axis(name: str) -> Axis:
    """The grid axis of the drafter option `name` (a key of GRID_AXES)."""
    return Axis(name, OPTION_LABELS.get(name, name + "={}"))

# A point's options passed through as they are; `Rule` may adjust a point's values (a tree drafts its own depth).
Rule = Callable[[dict[str, Any]], dict[str, Any]]


def _as_is(values: dict[str, Any]) -> dict[str, Any]:
    return values


@dataclass(frozen=True)
class MethodSpec:
    """One method of `mtp-eval`: its name in the config, how reports show it, its grid axes and its proposers.

    Args:
        name: the value of `method=` and of the rows' "method".
        display: how labels, plots and summaries name it.
        axes: the grid axes it may own, in label order: they multiply its runs, their values are its points' options
            (besides k and temperature); the grid's other keys are not its own.
        axes_for: the axes it owns in one evaluation when they depend on what it runs (the head's: its type's
            drafter's), a subset of `axes`, or a ValueError for a grid it cannot run; None = `axes`.
        build: (what `load` gave, a point's options, config) → a fresh proposer; None for plain decoding, the
            baseline every other method is measured against.
        load: what all its proposers share, loaded once per evaluation.
        lookup_beside: prompt lookup runs beside it on the same prompts when `ngram.compare` is on.
        rule: the method's own adjustment of one point's axis values (e.g. a tree's depth sets k).
    """

    name: str
    display: str
    axes: tuple[Axis, ...]
    build: Builder | None = None
    load: Loader = _load_nothing
    lookup_beside: bool = False
    rule: Rule = _as_is
    axes_for: Callable[[EvalConfig], tuple[Axis, ...]] | None = None

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def grid_axes(self, cfg: EvalConfig) -> tuple[Axis, ...]:
        """The axes it owns in the evaluation `cfg`."""
        return self.axes if self.axes_for is None else self.axes_for(cfg)

    @property
    def plain(self) -> bool:
        """True for the baseline (no proposer, the plain engine)."""
        return self.build is None


class GridPoint(Protocol):
    """What a proposer is built from: a method's name and its options (`mtp_train.eval.options.EvalPoint`)."""

    @property
    def method(self) -> str: ...

    @property
    def options(self) -> dict[str, Any]: ...


METHODS: Registry[MethodSpec] = Registry("eval method")  # each added below, where it is defined
LOOKUP = "ngram"  # the floor a trained drafter has to clear: its figures join every other row (`attach_ngram`)
HEAD = "head"  # the method that runs a trained head (MethodSet's shared entry for it is the loaded head)


def method_spec(name: str) -> MethodSpec:
    """The registered spec of `name`; an unknown name is refused with the valid ones."""
    return METHODS.get(name)


def grid_methods(cfg: EvalConfig) -> list[MethodSpec]:
    """The methods one evaluation runs: the plain baseline, `cfg.method`, and prompt lookup beside it when the
    method asks for it and `ngram.compare` is on (the baseline alone for method=none)."""
    chosen = method_spec(cfg.method)
    specs = [spec for spec in METHODS.values() if spec.plain]
    if not chosen.plain:
        specs.append(chosen)
    if chosen.lookup_beside and cfg.ngram.compare:
        specs.append(METHODS[LOOKUP])
    return specs


class MethodSet:
    """The methods of one evaluation with what their proposers share, loaded once: `proposer(point)` builds a
    fresh one per engine."""

    def __init__(self, cfg: EvalConfig, shared: Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.shared = dict(shared or {})  # method name → its loader's result (a head, a draft model)

    @classmethod
    def load(cls, cfg: EvalConfig, target: CausalLM, tokenizer: Any, target_dir: Path,
             points: Iterable[GridPoint] = ()) -> MethodSet:
        """Load every method of `cfg`'s grid, then build each of `points`' proposers once and drop it, so a bad
        option value (a threshold, a width, n_min) fails before any run."""
        shared = {spec.name: spec.load(cfg, target, tokenizer, target_dir) for spec in grid_methods(cfg)}
        methods = cls(cfg, shared)
        for p in points:
            methods.proposer(p)
        return methods

    def proposer(self, point: GridPoint) -> Proposer | None:
        """A fresh proposer for one grid point (its method with its options); None for plain decoding."""
        spec = method_spec(point.method)
        if spec.build is None:
            return None
        return spec.build(self.shared.get(point.method), point.options, self.cfg)


def _load_head(cfg: EvalConfig, target: CausalLM, tokenizer: Any, target_dir: Path) -> Any:
    if not cfg.head_ckpt:
        raise ValueError("method=head needs head_ckpt=DIR (a folder written by mtp-train or mtp-export)")
    from mtp_train.heads import load_head

    head = load_head(cfg.head_ckpt, target_dir, device=target.device, dtype=target.dtype,
                     backend=cfg.model.backend, verify_fingerprint=cfg.verify_fingerprint)
    streamed = head.stream_weights(None if cfg.head_weights == "fp32" else cfg.head_weights)
    log.info("head %s: %s, %.2fM parameters, draft vocabulary %d%s", cfg.head_ckpt, head.cfg.type,
             head.num_params() / 1e6, head.vocab_size,
             f", {streamed} linears streamed as {cfg.head_weights}" if streamed else "")
    return head


def _load_draft(cfg: EvalConfig, target: CausalLM, tokenizer: Any, target_dir: Path) -> CausalLM:
    if not cfg.draft_model:
        raise ValueError("method=draft needs draft_model=DIR (a Hugging Face folder with the target's tokenizer)")
    from mtp_train.models.loader import load_model

    draft_dir = Path(cfg.draft_model)
    if tokenizer_fingerprint(load_tokenizer(draft_dir)) != tokenizer_fingerprint(tokenizer):
        raise ModelConfigError(f"draft model {draft_dir} has another tokenizer than the target {target_dir}; "
                               "speculative decoding needs the same one")
    draft = load_model(draft_dir, dtype=str(target.dtype).replace("torch.", ""), device=target.device,
                       backend=cfg.model.backend)
    if draft.args.vocab_size != target.args.vocab_size:
        raise ModelConfigError(f"draft model {draft_dir} has vocab_size {draft.args.vocab_size}, the target "
                               f"{target.args.vocab_size}")
    return draft


def _tree_rule(values: dict[str, Any]) -> dict[str, Any]:
    """A tree drafts its own depth: its point runs at k = its steps, once, whatever the draft widths."""
    if values.get("tree", "none") == "none":
        return values
    return {**values, "k": int(values["tree"].split("x")[0]), **({"draft_width": 1} if "draft_width" in values else {})}


METHODS.add(MethodSpec("none", "plain", axes=(TEMPERATURE,)))
# The default of each grid axis (EvalConfig's): an axis a head type's drafter does not take may only stay at it.
_AXIS_DEFAULTS = {f.name: f.default for f in fields(EvalConfig) if f.name in GRID_AXES}


def _foreign_options(kind: Any, options: Mapping[str, Iterable[Any]]) -> None:
    """Refuse a drafter option the head type's drafter does not take, set away from its default (every value of
    `options[name]` is one the grid or a point sets)."""
    foreign = [f"{k}={v}" for k, vs in options.items() if k not in kind.draft_options for v in vs
               if v != _AXIS_DEFAULTS.get(k)]
    if foreign:
        takes = ", ".join(kind.draft_options) or "none"
        raise ValueError(f"{kind.name} heads draft with their own drafter, which takes no {', '.join(foreign)} "
                         f"(its options: {takes})")


def _head_axes(cfg: EvalConfig) -> tuple[Axis, ...]:
    """The head's axes: k, its head type's drafter options (`HeadType.draft_options`, the type read from
    `head_ckpt`'s config.json), temperature; any other option set away from its default is refused. Without a head
    folder (a caller passing its own head to `MethodSet`; a folder that is not there, which loading the head names),
    every drafter option of the grid; the drafter refuses the foreign ones when it is built."""
    if not cfg.head_ckpt or not (Path(cfg.head_ckpt) / "config.json").is_file():
        return HEAD_AXES
    from mtp_train.heads import read_head_config

    kind = head_type(read_head_config(cfg.head_ckpt)["head"]["type"])
    _foreign_options(kind, {o: cfg.grid(o) for o in DRAFT_OPTIONS})
    return (K, *(option_axis(o) for o in kind.draft_options), TEMPERATURE)


def _build_head(head: Any, opts: Mapping[str, Any], cfg: EvalConfig) -> Proposer:
    """The head's proposer for one point: its head type's drafter (`HeadType.drafter`) with the point's options
    that the drafter takes (`HeadType.draft_options`); another option set away from its default is refused."""
    kind = head_type(head.cfg.type)
    _foreign_options(kind, {k: [v] for k, v in opts.items()})
    return kind.drafter(head, {k: v for k, v in opts.items() if k in kind.draft_options})


# Every drafter option a head may own; `_head_axes` keeps those of the evaluated head's drafter.
HEAD_AXES = (K, *(option_axis(o) for o in DRAFT_OPTIONS), TEMPERATURE)
METHODS.add(MethodSpec(HEAD, "head", axes=HEAD_AXES, axes_for=_head_axes, build=_build_head, load=_load_head,
                       lookup_beside=True, rule=_tree_rule))
METHODS.add(MethodSpec("draft", "draft model", axes=(K, TEMPERATURE),
                       build=lambda model, opts, cfg: DraftModelProposer(model), load=_load_draft, lookup_beside=True))
METHODS.add(MethodSpec("ngram", "prompt lookup", axes=(K, TEMPERATURE),
                       build=lambda _, opts, cfg: NgramProposer(n_max=cfg.ngram.n_max, n_min=cfg.ngram.n_min)))
