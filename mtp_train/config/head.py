"""Which draft head to train, with which norms and input features (`conf/head/*.yaml`); saved with every head.

A head type is one plug-in, a `HeadType` registered once in `HEAD_TYPES`: its settings (`HeadTypeSpec`: norm
defaults and which of them are fixed, the features its step 0 reads, its draft-vocabulary rule), its module
class, its inference drafter, its validation path and its export layouts (with the engines that serve them). The
plug-ins are found on the registry's first read: this package's own by scanning `mtp_train/head_types/` (one folder
per type, whose `__init__` defines `HEAD_TYPE`), another installed package's through an entry point of
`HEAD_TYPE_GROUP`; a head type can also be registered at run time (`HEAD_TYPES.add`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtp_train.config.registry import Registry

# How a new head's weights start: random | the target's last decoder layer | the target's own MTP layer
# (DeepSeek-V3 / Kimi-K2 checkpoints' `model.layers.{L}.*`, fine-tuned in place: head_types/mtp/head.py)
INITS = ("scratch", "last_layer", "target_mtp")
FEATURES = ("final", "aux")  # what step 0 reads: the target's last hidden, or its aux layers concatenated
FEATURE_NAMES = {"final": "the final hidden state", "aux": "the aux layers"}  # FEATURES in messages
NORM_FLAGS = ("enorm", "hnorm", "input_norm", "final_norm")  # HeadConfig's norm switches


@dataclass(frozen=True)
class HeadTypeSpec:
    """One head type, as the settings see it (the torch side registers its class and layouts by `name`)."""

    name: str  # HeadConfig.type
    summary: str  # one line for messages and docs
    norms: dict[str, bool]  # the default of every NORM_FLAGS switch, taken when HeadConfig leaves it None
    # Norm switches that must stay at their default (the type's layout has them in fixed places).
    fixed_norms: tuple[str, ...] = ()
    features: str = "final"  # step 0's input by default: final | aux (FEATURES)
    fixed_features: bool = False  # the type reads only `features` (HeadConfig.features may not say otherwise)
    # The head has its own lm_head over a draft vocabulary: draft_vocab_size must be > 0 (capped at the target's
    # vocabulary), and the draft_vocab buffer exists even when it covers the whole vocabulary.
    draft_vocab_required: bool = False
    inits: tuple[str, ...] = ("scratch",)  # the HeadConfig.init values this type takes (INITS)
    # A block drafter (dflash, dspark): it drafts a block of positions per forward from its anchors, so its loss rows
    # and its memory are its settings' anchors and blocks (`train/memory_plan.py`), not one row per position.
    block: bool = False
    # Its own settings (head.<key> beside the shared ones): a `HeadSettings` dataclass, checked by it, held typed in
    # `HeadConfig.settings`; None = the type has no settings of its own.
    settings: type | None = None
    # (target layers) → the default aux_layers (hidden_states numbering) when head.aux_layers is []; None =
    # EAGLE-3's low / mid / high (`default_aux_layers`).
    aux_default: Callable[[int], list[int]] | None = None

    def __post_init__(self) -> None:
        if set(self.norms) != set(NORM_FLAGS):
            raise ValueError(f"head type {self.name}: norms must set exactly {', '.join(NORM_FLAGS)}")
        if not set(self.fixed_norms) <= set(NORM_FLAGS) or self.features not in FEATURES:
            raise ValueError(f"head type {self.name}: unknown fixed norm or features {self.features!r}")
        if not set(self.inits) <= set(INITS):
            raise ValueError(f"head type {self.name}: unknown inits {sorted(set(self.inits) - set(INITS))}")

    @property
    def formats(self) -> tuple[str, ...]:
        """The `mtp-export format=` values that take this type: native and its plug-in's layouts
        (`HeadType.formats`)."""
        return head_type(self.name).formats

    def input_width(self, features: str, num_aux_layers: int, hidden_size: int) -> int:
        """Width of step 0's input rows: k·H for features=aux over k layers, else H."""
        return (max(1, num_aux_layers) if features == "aux" else 1) * hidden_size


@dataclass(frozen=True)
class HeadType:
    """One head type as a plug-in: everything that differs between head types, registered once (`HEAD_TYPES`).

    Its module under `mtp_train.head_types` builds it; everything else asks the registry, never compares the type's
    name. The parts are plain callables and classes, so this floor needs none of their imports.

    Args:
        spec: its settings (norm defaults, features, draft vocabulary, inits).
        module: its `DraftHead` subclass (`mtp_train.heads.base`); the class's `unroll` is its training unroll: the
            input each step reads and the target row it is scored against (row i of step j predicts h_{i+j+1}).
        drafter: `(head, options) -> Proposer`, the head's proposer for speculative decoding with the options of one
            eval grid point (`draft_threshold`, `draft_width`, `tree`, ...; {} = the defaults): a chain, a tree, or
            anything else that returns `DraftTree`s.
        inference_path: `(head, inputs (T, W), input_ids (T,), seq_lens, steps) -> [(T, H)] * steps`, the training
            validation through the head's inference path: row i of step j is what drafting from position i gives
            at its (j+1)-th draft (compared with `unroll`'s rows by the tests).
        draft_options: the eval grid axes its drafter takes (besides `k` and `temperature`, which every drafter
            takes); a grid point's other axes are not its own.
        layouts: its export layouts (`mtp_train.export.layouts.Layout`, built in its folder): `mtp-export format=`
            takes `native` and each one's name for this type, the export registry `LAYOUTS` is filled from them,
            and a layout with a reader is what `mtp-export import_from=` reads back. Each says which serving
            engines load it and how (`Layout.serves`).
        foreign_targets: the head takes a target no family runs (`models/foreign.py`): its block is a layer of its
            own built from the target's shapes alone, and `mtp-eval backend=vllm` measures it.
    """

    spec: HeadTypeSpec
    module: type
    drafter: Callable[[Any, Mapping[str, Any]], Any]
    inference_path: Callable[..., list[Any]]
    draft_options: tuple[str, ...] = ()
    layouts: tuple[Any, ...] = ()
    foreign_targets: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def formats(self) -> tuple[str, ...]:
        """The `mtp-export format=` values that take this type: native and its layouts' names."""
        return ("native", *(layout.name for layout in self.layouts))

    def serving(self, engine: str) -> tuple[str, dict[str, Any]] | None:
        """(the name of its first layout `engine` loads, the engine's speculative settings that select its drafter,
        e.g. ("speculators", {"method": "eagle3"}) for vLLM), or None when no layout of this type is served there.

        Args:
            engine: a serving engine's name as the layouts spell it: "vllm" | "sglang".
        """
        for layout in self.layouts:
            if engine in layout.serves:
                return layout.name, dict(layout.serves[engine])
        return None


@dataclass(frozen=True)
class HeadTypesWhere:
    """The registered head types that `accepts`, as a collection of names (`in`, iteration, `len`): where a set of
    head types is a property of the types (a family's block, a foreign target), never a list of their names."""

    accepts: Callable[[HeadType], bool]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in HEAD_TYPES and self.accepts(HEAD_TYPES.get(name))

    def __iter__(self) -> Iterator[str]:
        return iter([name for name, t in HEAD_TYPES.items() if self.accepts(t)])

    def __len__(self) -> int:
        return len(list(iter(self)))


HEAD_TYPE_GROUP = "mtp_train.head_types"  # the entry-point group another package registers its head types under
HEAD_TYPE_PACKAGE = "mtp_train.head_types"  # the in-tree plug-ins: one sub-package per head type, found by scanning


# The plug-ins live above this floor (they need torch, the heads and the engine): the in-tree ones are the
# sub-packages of HEAD_TYPE_PACKAGE that define HEAD_TYPE, found by scanning the folder on the first read (a new
# folder needs no reinstall; modules beside the folders, like chain.py, are parts several types share); another
# installed package adds its own through an entry point of HEAD_TYPE_GROUP naming a module's HeadType.
HEAD_TYPES: Registry[HeadType] = Registry("head type", HEAD_TYPE_PACKAGE, attr="HEAD_TYPE", packages_only=True,
                                          optional=True, group=HEAD_TYPE_GROUP, entry_type=HeadType)


def head_type(name: str) -> HeadType:
    """The registered head type `name`; ValueError naming the known types otherwise."""
    return HEAD_TYPES.get(name)


def head_spec(name: str) -> HeadTypeSpec:
    """The settings spec of head type `name`; ValueError naming the known types otherwise."""
    return HEAD_TYPES.get(name).spec


def head_types_taking(accepts: Callable[[HeadTypeSpec], bool]) -> list[str]:
    """The names of the registered head types whose spec `accepts` (for messages)."""
    return [name for name, t in HEAD_TYPES.items() if accepts(t.spec)]


def aux_layers_problem(aux_layers: Sequence[int], num_layers: int | None = None) -> str | None:
    """Why `aux_layers` cannot be the aux layers of a target of `num_layers` layers, in words, or None: each is a hidden
    state in transformers' `hidden_states[j]` numbering, 0 (the embeddings) .. num_layers (the last layer's output),
    each once. Without a layer count only the lower bound and the repeats are checked. The one rule the head's
    settings, the precompute, its manifest and a capture inside vLLM apply (each names its own key)."""
    layers = [int(j) for j in aux_layers]
    bad = [j for j in layers if j < 0 or (num_layers is not None and j > num_layers)]
    if bad:
        where = (f"this target (its hidden states are 0..{num_layers}, transformers' hidden_states numbering)"
                 if num_layers is not None else "any target (hidden states are numbered from 0, the embeddings)")
        return f"{', '.join(map(str, bad))} {'is' if len(bad) == 1 else 'are'} not a layer of {where}"
    repeated = sorted({j for j in layers if layers.count(j) > 1})
    if repeated:
        return f"{', '.join(map(str, repeated))} {'is' if len(repeated) == 1 else 'are'} given twice (each layer once)"
    return None


def check_aux_layers(aux_layers: Sequence[int], num_layers: int | None, key: str = "aux_layers",
                     error: type[Exception] = ValueError) -> None:
    """Raise `error` naming `key` where `aux_layers_problem` finds one."""
    problem = aux_layers_problem(aux_layers, num_layers)
    if problem is not None:
        raise error(f"{key}={list(aux_layers)}: {problem}")


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high target layers in `hidden_states[j]` numbering: [2, L//2, L-3] (vLLM's default)."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class HeadSettings:
    """A head type's own settings (`HeadTypeSpec.settings` names its subclass; this empty base is the settings of
    a type that has none). The user writes them flat beside the shared ones (`head.block_size=16`, a head's
    config.json, `conf/head/<type>.yaml`); `HeadConfig.settings` holds them typed. A subclass checks its values in
    `__post_init__` (a ValueError naming `head.<key>` and what to give) and may override the hooks below."""

    def resolved(self) -> HeadSettings:
        """A copy with every null that stands for a default replaced by it (e.g. DSpark's markov_rank)."""
        return dataclasses.replace(self)

    def derived(self) -> dict[str, Any]:
        """Settings of other groups that follow from these, by dotted key (e.g. {"loss.steps": 7} for a block of
        8): taken where the user left them unset, refused where the user set another value (`TrainConfig`)."""
        return {}

    def derived_from(self, key: str) -> str:
        """Which of these settings `derived()[key]` follows from, for messages (e.g. "head.block_size=8 - 1")."""
        return ""

    def fit_problem(self, max_positions: int, hidden_size: int, free_bytes: Callable[[], int | None],
                    human: Callable[[int], str], target: str, device: str) -> str | None:
        """What of these settings a target cannot hold, in words naming the key, or None (checked by mtp-train
        before anything is written).

        Args:
            max_positions: the target's max_position_embeddings.
            hidden_size: the target's H.
            free_bytes: () -> the bytes free on the training device (None: unknown); called only when needed.
            human: bytes -> "1.5 GiB" (for messages).
            target, device: the target's config.json and the device, as messages name them.
        """
        return None


@dataclass
class HeadConfig:
    """Which head, with which norms: the settings every head type shares, and `settings`, the type's own
    (`HeadTypeSpec.settings`). A norm left as None takes the default of the type (mtp: on, eagle1: off).

    Flat keys (`head.block_size=16`, a saved head's config.json) build one with `of` / `from_dict`; `to_dict` gives
    the flat form back."""

    type: str = "mtp"  # a HEAD_TYPES name: mtp (RMSNorm-restored, DeepSeek-V3 MTP) | eagle1 (EAGLE) | eagle3 (EAGLE-3)
    enorm: bool | None = None  # RMSNorm on the token embedding before the fc; null = the type's default
    hnorm: bool | None = None  # RMSNorm on the input hidden state before the fc; null = the type's default
    input_norm: bool | None = None  # the decoder layer's input_layernorm; null = the type's default
    final_norm: bool | None = None  # RMSNorm after the layer (its output is the predicted feature); null = default
    fc_bias: bool = False  # bias on the 2H→H fc (vLLM's EAGLE layout has none, SGLang's has one)
    moe: bool = False  # DeepSeek-V2 targets: an MoE block (the target's experts' shapes) instead of a dense MLP
    # scratch (random) | last_layer (copy the target's last decoder layer) | target_mtp (the target checkpoint's own
    # MTP layer, mtp heads only: every norm on, no fc bias, features=final; head.moe as that layer's MLP)
    init: str = "scratch"
    # Draft over the N most frequent target tokens only (EAGLE-3's draft vocabulary, FR-Spec): the head's logits
    # are lm_head rows of those tokens, so each draft step and the training loss cost N/V of the full lm_head.
    # 0 = the target's whole vocabulary. The token ids are a buffer of the head (`draft_vocab`), saved with it.
    # eagle3 needs N > 0 (capped at the target's vocabulary) and trains its own lm_head rows.
    draft_vocab_size: int = 0
    # Step 0's input: final (the target's last hidden after the final norm) | aux (the aux layers' hidden states,
    # concatenated, through an fc k·H → H); null = the type's default (mtp, eagle1: final; eagle3: aux, only).
    features: str | None = None
    # Target layers of the aux features, in transformers' hidden_states[j] numbering (0 = the embeddings, j = the
    # output of decoder layer j-1); [] = EAGLE-3's default [2, L//2, L-3]. Only with features=aux.
    aux_layers: list[int] = field(default_factory=list)
    # EAGLE-3.1 (speculators' `fc_norm`): one RMSNorm per aux layer on its H-slice of the (T, k·H) step-0 input,
    # before the k·H → H fc. Only with features=aux.
    aux_norm: bool = False
    # The type's own settings: an instance of its `HeadTypeSpec.settings` (dflash: head_types/dflash/settings.py
    # `BlockSettings`), or the empty `HeadSettings` of a type without; None = the type's defaults. A mapping of
    # its keys is taken too.
    settings: HeadSettings | None = None

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0 = the full vocabulary), got {self.draft_vocab_size}")
        spec = head_spec(self.type)
        own = settings_class(self.type)
        if self.settings is None:
            self.settings = own()
        elif isinstance(self.settings, Mapping):
            self.settings = own(**self.settings)
        elif type(self.settings) is not own:
            raise ValueError(f"head.settings is a {type(self.settings).__name__}: {self.type} heads take "
                             f"{own.__name__} (build the config with HeadConfig.of(type=..., <key>=...))")
        if self.init not in INITS:
            raise ValueError(f"unknown head init {self.init!r}; choose one of {', '.join(INITS)}")
        if self.init not in spec.inits:
            takes = head_types_taking(lambda s: self.init in s.inits)
            raise ValueError(f"head.init={self.init} takes {'/'.join(takes)} heads; {self.type} heads start "
                             f"from {' | '.join(spec.inits)}")
        if self.features is not None and self.features not in FEATURES:
            raise ValueError(f"unknown head features {self.features!r}; choose one of {', '.join(FEATURES)}")
        off = [k for k in spec.fixed_norms if getattr(self, k) is not None and getattr(self, k) != spec.norms[k]]
        if off:
            raise ValueError(f"{self.type} heads have fixed norms; {', '.join(off)} cannot be switched "
                             f"{'off' if spec.norms[off[0]] else 'on'}")
        if spec.fixed_features and self.features not in (None, spec.features):
            raise ValueError(f"{self.type} heads read {FEATURE_NAMES[spec.features]} only "
                             f"(head.features={spec.features})")
        if spec.draft_vocab_required and self.draft_vocab_size == 0:
            raise ValueError(f"{self.type} heads draft over their own draft vocabulary: set head.draft_vocab_size "
                             "> 0 (conf/head/eagle3.yaml: 32000, capped at the target's vocabulary)")
        if self.aux_layers and self.resolved_features != "aux":
            raise ValueError(f"head.aux_layers={list(self.aux_layers)} needs head.features=aux")
        check_aux_layers(self.aux_layers, None, "head.aux_layers")
        if self.aux_norm and self.resolved_features != "aux":
            raise ValueError("head.aux_norm=true needs head.features=aux: it norms each aux layer's slice before the "
                             "fc, and a head over the final hidden state has no aux layers")
        if self.init == "target_mtp":
            problems = target_mtp_problems(self)
            if problems:
                raise ValueError("head.init=target_mtp copies the target's MTP layer (enorm, hnorm, eh_proj without "
                                 "bias, the block, shared_head.norm) and has no place for: " + "; ".join(problems))

    @classmethod
    def of(cls, type: str = "mtp", **keys: Any) -> HeadConfig:  # noqa: A002 (the setting's name)
        """A head config from flat keys, as `head.<key>` says them: the shared ones and the type's own settings
        (e.g. `HeadConfig.of(type="dflash", layers=2, block_size=4)`). A key neither shared nor the type's own is
        a ValueError naming the type that owns it, or the nearest valid key."""
        own = {f.name for f in dataclasses.fields(settings_class(type))}
        shared, mine = {}, {}
        for key, value in keys.items():
            problem = head_key_problem(type, key)
            if problem:
                raise ValueError(problem)
            (mine if key in own else shared)[key] = value
        return cls(type=type, **shared, settings=settings_class(type)(**mine))

    @classmethod
    def from_dict(cls, flat: Mapping[str, Any]) -> HeadConfig:
        """A head config from its flat form (`to_dict`, a saved head's config.json, `conf/head/*.yaml`). A head saved
        before the types had settings of their own recorded every type's keys; those another type owns are
        dropped where they hold the value such a head recorded (`LEGACY_KEYS`)."""
        return cls.of(**without_legacy_keys(flat))

    @property
    def spec(self) -> HeadTypeSpec:
        """The registered spec of this head's type."""
        return head_spec(self.type)

    @property
    def resolved_features(self) -> str:
        return self.spec.features if self.features is None else self.features

    def resolved(self, num_layers: int | None = None) -> HeadConfig:
        """A copy with every norm flag and `features` set (None → the type's default) and the type's settings
        resolved (`HeadSettings.resolved`); given the target's layer count, empty aux_layers of an aux head become
        the default ones (checked against the count)."""
        defaults = self.spec.norms
        assert self.settings is not None  # set by __post_init__
        out = dataclasses.replace(self, features=self.resolved_features, aux_layers=[int(j) for j in self.aux_layers],
                                  settings=self.settings.resolved(),
                                  **{k: v if getattr(self, k) is None else getattr(self, k)
                                     for k, v in defaults.items()})
        if num_layers is not None and out.features == "aux":
            default = self.spec.aux_default or default_aux_layers
            layers = out.aux_layers or default(num_layers)
            check_aux_layers(layers, num_layers, "head.aux_layers" if out.aux_layers else
                             f"head.aux_layers (the {self.type} default)")
            out.aux_layers = layers
        return out

    def to_dict(self, resolve: bool = True) -> dict[str, Any]:
        """The flat form: the shared keys and the type's own (what a head's config.json records, resolved;
        `resolve=False`: as set, nulls kept, as a run's train_config.yaml records them)."""
        out = self.resolved() if resolve else self
        assert out.settings is not None  # set by __post_init__
        flat = {f.name: copy.deepcopy(getattr(out, f.name)) for f in dataclasses.fields(out) if f.name != "settings"}
        return {**flat, **dataclasses.asdict(out.settings)}


def settings_class(name: str) -> type[HeadSettings]:
    """The settings dataclass of head type `name` (`HeadTypeSpec.settings`; the empty `HeadSettings` if none)."""
    return head_spec(name).settings or HeadSettings


SHARED_KEYS = tuple(f.name for f in dataclasses.fields(HeadConfig) if f.name != "settings")  # head.<key> of every type


def head_keys(name: str) -> list[str]:
    """The flat `head.<key>`s of head type `name`: the shared ones, then its own settings'."""
    return [*SHARED_KEYS, *(f.name for f in dataclasses.fields(settings_class(name)))]


def key_owners(key: str) -> list[str]:
    """The registered head types whose own settings have `key` (none for a shared or unknown key)."""
    return [name for name in HEAD_TYPES.names() if key in {f.name for f in dataclasses.fields(settings_class(name))}]


def head_key_problem(name: str, key: str) -> str | None:
    """Why `head.<key>` is not a setting of head type `name`, in words, or None when it is one: another type's
    setting names the type(s) that own it, an unknown key the nearest valid one (difflib)."""
    keys = head_keys(name)
    if key in keys:
        return None
    owners = key_owners(key)
    if owners:
        return (f"head.{key} is {_a(owners[0])} {' / '.join(owners)} setting "
                f"({' or '.join(f'head={o}' for o in owners)}); {name} heads have no such setting")
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    others = sorted({k for t in HEAD_TYPES.names() for k in head_keys(t)} - set(keys))
    near_other = [] if near else difflib.get_close_matches(key, others, n=1, cutoff=0.6)
    if near:
        hint = f"did you mean `head.{near[0]}`?"
    elif near_other:
        hint = (f"did you mean `head.{near_other[0]}`? (a setting of {' / '.join(key_owners(near_other[0]))} "
                f"heads, not of {name} heads)")
    else:
        hint = f"the keys of {_a(name)} {name} head are: {', '.join(keys)}"
    return f"unknown config key `head.{key}` ({name} heads have no such setting); {hint}"


def _a(word: str) -> str:
    return "an" if word[:1].lower() in "aeio" else "a"


def flat_schema(name: str) -> type:
    """A dataclass of the flat `head.<key>`s of head type `name`, with their types and defaults (for checking a
    value's type as Hydra would: `config.checks`)."""
    own = settings_class(name)
    hints = {**typing.get_type_hints(HeadConfig), **typing.get_type_hints(own)}
    fields = [(f.name, hints[f.name], dataclasses.field(default=f.default, default_factory=f.default_factory))
              for f in (*dataclasses.fields(HeadConfig), *dataclasses.fields(own)) if f.name != "settings"]
    return dataclasses.make_dataclass(f"{own.__name__}Flat", fields)


def without_legacy_keys(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`flat` (a head's flat keys) without the `LEGACY_KEYS` its type does not take that hold their legacy value."""
    mine = set(head_keys(str(flat.get("type", HeadConfig.type))))
    return {k: v for k, v in flat.items() if k in mine or k not in LEGACY_KEYS or v != LEGACY_KEYS[k]}


# The keys every head's config.json recorded before the types had settings of their own, with the value a type
# that did not use them recorded: `HeadConfig.from_dict` drops them there, so that such a folder still loads.
LEGACY_KEYS: dict[str, Any] = {"layers": 1, "block_size": 8, "mask_token_id": None, "max_anchors": 512,
                               "markov_rank": None, "confidence_head": False, "confidence_with_markov": False,
                               "norm_output": False}


def target_mtp_problems(cfg: HeadConfig) -> list[str]:
    """The settings (named by their keys) an mtp head cannot have to take a DeepSeek-style MTP layer 1:1: each of the
    layer's RMSNorms needs its switch on, eh_proj has no bias, and the layer reads the target's final hidden state.
    Whether the block is MoE (head.moe) is the checkpoint's to say: checked against it when the layer is read."""
    problems = [f"head.{flag}=false (the layer has its norm)" for flag in NORM_FLAGS if getattr(cfg, flag) is False]
    if cfg.fc_bias:
        problems.append("head.fc_bias=true (eh_proj has no bias)")
    if cfg.resolved_features != "final":
        problems.append(f"head.features={cfg.features} (the layer reads the target's final hidden state)")
    return problems
