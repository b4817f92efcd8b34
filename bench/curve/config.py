"""The learning curve's settings: conf/experiment/curve.yaml typed, the heads it names, and its recipe variants.

A variant is a name, a conf/head name and overrides, e.g. `mtp-lk_hybrid-s1: {head: mtp, overrides:
[loss.kind=lk_hybrid, loss.steps=1]}` (the config's `variants:` block, or a `--variants-file` holding one). Its
mtp-train overrides are the curve's `train:` overrides, the command line's, then its own (later ones win in Hydra,
so a variant's `loss.steps` wins over the shared `loss.steps=1`); it trains into `<out>/variants/<name>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import ROOT

CONFIG = ROOT / "conf" / "experiment" / "curve.yaml"
VARIANTS_DIR = "variants"


@dataclass
class TokenPoints:
    first: int = 16384  # the first evaluation point, in training tokens
    last: int = 1048576  # the budget (and the last point)


@dataclass
class CurveEval:
    prompts: list[str] = field(default_factory=lambda: ["demo-heldout"])
    limit: int = 32
    k: int = 3
    max_new_tokens: int = 96
    batch_size: int = 8
    # The head's own best k, at the last point only (bench.curve.kgrid): τ measured at each k of the grid ([] = not
    # measured). A drafter that drafts at most m tokens whatever k is asked (a block drafter: its block's drafts)
    # takes `block_k_grid` cut at m instead, every k from 1 to m when that is [].
    k_grid: list[int] = field(default_factory=list)
    block_k_grid: list[int] = field(default_factory=list)


@dataclass
class CurveData:
    """Conversations the curve precomputes itself: `name` (a conf/data name) with its `paths` replaced. Without
    paths, the shared self-distilled set when ../shared/data has it, else the demo's own conversations."""

    name: str = "demo-regen"
    paths: list[str] = field(default_factory=list)  # relative to the working directory (the checkout's root)


@dataclass
class CurveConfig:
    """conf/experiment/curve.yaml, typed (a misspelt key is refused by name)."""

    heads: list[str] = field(default_factory=lambda: ["mtp", "eagle1"])
    tokens: TokenPoints = field(default_factory=TokenPoints)
    checkpoint_every: int = 64
    precompute: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    eval: CurveEval = field(default_factory=CurveEval)
    ngram: dict[str, int] = field(default_factory=lambda: {"n_max": 3, "n_min": 1})
    variants: dict[str, VariantSpec] = field(default_factory=dict)  # run by --variants
    full_curve: bool = False  # measure the variants at every point (as --full-curve), not the last only
    data: CurveData = field(default_factory=CurveData)
    # One precompute folder holding these target layers (hidden_states numbering) for every head and variant, each
    # checked to read only layers it holds; None: one folder per set of layers the heads read.
    aux_layers: list[int] | None = None


def load_config(path: str | Path = CONFIG) -> CurveConfig:
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(CurveConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


# --- the heads ---------------------------------------------------------------------------------------------------


def head_available(name: str) -> str | None:
    """None when conf/head/<name>.yaml exists and its type is implemented, else why the head is skipped."""

    from mtp_train.config import HEAD_TYPES

    path = ROOT / "conf" / "head" / f"{name}.yaml"
    if not path.is_file():
        return f"no conf/head/{name}.yaml"
    type_ = str(head_conf(name).get("type", name))
    if type_ not in HEAD_TYPES:
        return f"head type {type_!r} has no implementation yet (known: {', '.join(sorted(HEAD_TYPES))})"
    return None


def head_conf(name: str) -> Any:
    """The `head` block of conf/head/<name>.yaml (a `# @package _global_` file nests it under `head:`)."""
    from omegaconf import OmegaConf

    conf = OmegaConf.load(ROOT / "conf" / "head" / f"{name}.yaml")
    return conf.head if "head" in conf else conf


def head_aux_layers(name: str, num_layers: int) -> list[int]:
    """The target layers (hidden_states numbering) a head reads as features; [] for heads on the final state.

    A head with `features: aux` (eagle3) needs a precompute folder that holds those layers; every other head
    trains on a folder without them (the same samples, so the same batches).
    """
    from mtp_train.config.head import default_aux_layers

    head = head_conf(name)
    if str(head.get("features", "final")) != "aux":
        return []
    return [int(j) for j in (head.get("aux_layers") or [])] or default_aux_layers(num_layers)


def reads_layers(train_conf: Any, num_layers: int) -> list[int]:
    """The target layers a composed mtp-train config's head reads ([] for a head on the final state): its type's
    defaults resolved against the target's layer count, after every override (a variant's `head.features=aux`,
    a recipe's head), which `head_aux_layers` (the conf/head file alone) cannot see."""
    from mtp_train.config import TrainConfig, typed

    head = typed(train_conf, TrainConfig).head.resolved(num_layers)
    return [int(j) for j in head.aux_layers] if head.features == "aux" else []


# --- recipe variants ---------------------------------------------------------------------------------------------


@dataclass
class VariantSpec:
    """One entry of a `variants:` block (its name is the key)."""

    head: str = "mtp"  # a conf/head name
    overrides: list[str] = field(default_factory=list)  # mtp-train key=value, applied after the curve's own


@dataclass(frozen=True)
class Variant:
    name: str
    head: str
    overrides: tuple[str, ...]


def parse_variants(block: Any) -> list[Variant]:
    """A `variants:` mapping (name → {head, overrides}), in its written order, as Variants.

    A name must be usable as a folder name; an override must be key=value (Hydra syntax is checked when the
    variant's config is composed).
    """
    out = []
    for name, spec in (block or {}).items():
        name = str(name)
        if not name or "/" in name or name.startswith("."):
            raise SystemExit(f"curve: variant name {name!r} is not a folder name")
        head = spec.head if isinstance(spec, VariantSpec) else str(spec.get("head", "mtp"))
        overrides = spec.overrides if isinstance(spec, VariantSpec) else list(spec.get("overrides", []))
        bad = [o for o in overrides if "=" not in str(o)]
        if bad:
            raise SystemExit(f"curve: variant {name}: overrides must be key=value, got {bad}")
        out.append(Variant(name, str(head), tuple(str(o) for o in overrides)))
    return out


def load_variants_file(path: str | Path) -> list[Variant]:
    """The variants of a YAML file: a `variants:` block, or the mapping itself at the top level."""
    from omegaconf import OmegaConf

    conf = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(conf, dict)
    return parse_variants(conf.get("variants", conf))


def select(variants: list[Variant], names: str | None) -> list[Variant]:
    """`names`: comma-separated variant names (run in the given order) or `all` (the config's order)."""
    if names is None or names.strip() in ("", "all"):
        return list(variants)
    by_name = {v.name: v for v in variants}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"curve: unknown variant(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in dict.fromkeys(wanted)]


def variant_overrides(shared: list[str], variant: Variant, run_dir: Path) -> list[str]:
    """The mtp-train overrides of a variant: the curve's (head, data, shared recipe, budget, command line), then
    the variant's own (later ones win in Hydra), then its run folder."""
    return [*shared, *variant.overrides, f"out={run_dir}"]
