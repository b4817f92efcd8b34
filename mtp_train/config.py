"""Typed configuration schemas, mirrored by the YAML files under `conf/`.

Every command's Hydra config is validated against these dataclasses (registered in Hydra's
ConfigStore as `<command>_schema`), so a misspelt key fails at start-up with the key's name
instead of being silently ignored: `check_overrides` and `check_config` (end of the module) also refuse the
keys Hydra itself lets through (`+key=value`), naming the nearest valid key, and values out of range.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from mtp_train.train.losses import LossConfig

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # the YAML tree (an editable install's checkout)


@dataclass
class ModelConfig:
    """The target model and how our engine runs it (`conf/model/*.yaml`)."""

    name: str = "smollm2-135m"  # short name, used in output folder names and manifests
    path: str = "models/smollm2-135m-instruct"  # Hugging Face folder: config.json + safetensors + tokenizer
    dtype: str = "auto"  # auto (checkpoint dtype) | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    backend: str = "auto"  # attention backend: auto (flashinfer on CUDA when installed) | torch | flashinfer
    page_size: int = 16  # tokens per KV-cache page
    kv_cache_gb: float = 1.0  # memory for the paged KV cache of one engine
    tp: int = 1  # tensor-parallel ranks per model replica (mtp-precompute under torchrun; groups of consecutive ranks)
    fetch: str | None = "smollm2-135m"  # `mtp-model fetch` name: creates `path` when missing, if its default folder


@dataclass
class DataConfig:
    """Where conversations come from and how they are read (`conf/data/*.yaml`)."""

    name: str = "custom"  # short name recorded in manifests
    paths: list[str] = field(default_factory=list)  # .jsonl/.json/.parquet/.csv files, folders, globs, HF datasets
    format: str = "auto"  # auto | sharegpt | messages | prompt
    field_map: dict[str, str] = field(default_factory=dict)  # our field name → the file's field name
    system_prompt: str | None = None  # added to every conversation that has no system turn
    on_bad_row: str = "error"  # error (stop, naming file:line) | skip (count and report)


@dataclass
class PrecomputeConfig:
    """`mtp-precompute`: conversations → target hidden states as sharded safetensors."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    out: str = "runs/precompute"  # output folder (shards + manifest.json); a re-run resumes
    max_seq_len: int = 2048  # longer samples are truncated (keeping the start)
    limit: int | None = None  # use only the first N conversations
    shard_tokens: int = 131072  # tokens per shard (2·H bytes each for the hidden states)
    batch_tokens: int = 8192  # tokens per packed prefill forward
    aux_layers: list[int] = field(default_factory=list)  # extra HF hidden_states[j] to store (EAGLE-3 features)
    val_fraction: float = 0.02  # share of samples recorded as the validation split
    seed: int = 0  # seeds the train/val split
    verify_on_resume: bool = True  # re-hash finished shards before skipping them
    progress: bool = True  # progress bar on rank 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}


@dataclass
class RegenerateConfig:
    """`mtp-regenerate`: answer the conversations' user turns with the target (self-distillation)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    out: str = "runs/regenerate/conversations.jsonl"  # messages JSONL with provenance; a re-run resumes
    n: int = 1  # samples per prompt
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 512  # per assistant turn
    seed: int = 0  # sampling seed (per prompt and sample index)
    limit: int | None = None  # use only the first N conversations
    max_batch_size: int = 32  # sequences decoded together
    max_prompt_tokens: int = 4096  # longer prompts are skipped and counted
    progress: bool = True  # progress bar on rank 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class NgramConfig:
    """Prompt lookup (training-free n-gram drafting) in `mtp-eval`: the floor a trained drafter must clear."""

    compare: bool = True  # also run prompt lookup at every k on the same prompts (rows method=ngram, tau_ngram)
    n_max: int = 3  # longest suffix tried first
    n_min: int = 1  # shortest suffix that still counts as a match


@dataclass
class EvalConfig:
    """`mtp-eval`: speculative decoding on held-out prompts, against plain decoding in the same run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    method: str = "mtp"  # mtp (a trained head) | draft (a small model) | ngram (prompt lookup) | none (plain only)
    head_ckpt: str | None = None  # head folder (mtp-train's heads/step-N or an mtp-export native folder)
    draft_model: str | None = None  # Hugging Face folder of the draft model (method=draft), same tokenizer
    prompts: list[str] = field(default_factory=lambda: ["demo-heldout"])  # conf/data names or prompt files
    k: Any = 4  # draft tokens per step (the most, with a threshold): an int or a list (a grid)
    draft_threshold: Any = 0.0  # mtp: stop a chain before a draft with top-1 prob below it; a float or a list
    catch_up: Any = "target"  # mtp: after verification re-run accepted rows on the target's h | own; or a list
    ngram: NgramConfig = field(default_factory=NgramConfig)
    temperature: Any = 0.0  # a float or a list (a grid); 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # request i of a turn is seeded seed + i
    max_new_tokens: int = 256  # per turn
    limit: int | None = None  # first N conversations of each prompt set
    batch_size: int = 1  # concurrent requests (1 = per-request latency, what speculation is for)
    warmup: bool = True  # one short untimed generation per engine first
    verify_fingerprint: bool = True  # refuse a head trained for other target weights
    out: str = "runs/eval"  # report.json, report.md, outputs.jsonl, *.png
    plots: bool = True
    progress: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExportConfig:
    """`mtp-export`: a trained head in a layout serving engines load."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the target the head was trained for
    head_ckpt: str | None = None  # head folder (mtp-train's heads/step-N)
    format: str = "native"  # native | vllm-eagle | sglang-eagle | deepseek-mtp | qwen3-next-mtp
    out: str = "runs/export"
    verify_fingerprint: bool = True  # refuse a head trained for other target weights


@dataclass
class DemoConfig:
    """`mtp-demo` (`conf/demo.yaml`): the pipeline's output folder and each stage's Hydra overrides."""

    out: str = "runs/demo"
    model_path: str = "models/smollm2-135m-instruct"  # fetched on first use when it is the default folder
    regenerate: list[str] = field(default_factory=list)
    precompute: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    export: list[str] = field(default_factory=list)


def resolve_device(device: str) -> str:
    """`auto` → cuda when available, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def register_configs() -> None:
    """Register the schemas with Hydra (idempotent); root YAMLs name them first in their defaults."""
    cs = ConfigStore.instance()
    cs.store(name="precompute_schema", node=PrecomputeConfig)
    cs.store(name="regenerate_schema", node=RegenerateConfig)
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="export_schema", node=ExportConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="head", name="head_schema", node=HeadCfg)
    cs.store(group="deepspeed", name="deepspeed_schema", node=DeepSpeedCfg)


# --- stage two: `mtp-train` -------------------------------------------------------------------------------------


@dataclass
class HeadCfg:
    """Which draft head to train (`conf/head/*.yaml`); mirrors `mtp_train.heads.HeadConfig`."""

    type: str = "mtp"  # mtp (RMSNorm-restored, DeepSeek-V3 MTP shape) | eagle1 (original EAGLE)
    enorm: bool | None = None  # RMSNorm on the token embedding before the fc; null = the type's default
    hnorm: bool | None = None  # RMSNorm on the input hidden state before the fc; null = the type's default
    input_norm: bool | None = None  # the decoder layer's input_layernorm; null = the type's default
    final_norm: bool | None = None  # RMSNorm after the layer (its output is the predicted feature); null = default
    fc_bias: bool = False  # bias on the 2H→H fc (vLLM's EAGLE layout has none, SGLang's has one)
    moe: bool = False  # DeepSeek-V2 targets: an MoE block (the target's experts' shapes) instead of a dense MLP
    init: str = "scratch"  # scratch (random) | last_layer (copy the target's last decoder layer)
    draft_vocab_size: int = 0  # draft over the N most frequent training tokens only; 0 = the full vocabulary


@dataclass
class TrainDataCfg(DataConfig):
    """Training data: the precompute folder `dir` (`mtp-precompute`'s `out`).

    The inherited fields (the `data=` group: name, paths, ...) name the conversations that folder was made
    from; training reads only `dir` and records the rest with the run.
    """

    dir: str = "runs/precompute"  # precompute folder: shards + manifest.json for this target
    num_workers: int = 0  # DataLoader worker processes per rank (0 = read in the training process)
    verify: str = "first_open"  # shard checksums: first_open | always (before training) | never (sizes only)


@dataclass
class OptimCfg:
    """AdamW and its learning-rate schedule (linear warmup, then cosine down to min_lr_ratio · lr)."""

    lr: float = 1e-4  # peak learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (beta1, beta2)
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 100  # optimizer steps of linear warmup from lr/warmup_steps to lr
    min_lr_ratio: float = 0.1  # the cosine ends at min_lr_ratio · lr at train.max_steps
    grad_clip: float = 0.5  # clip the global gradient norm to this (0 = off)


# The loss schema is the library's own dataclass, so the YAML and the code can never drift apart.
LossCfg = LossConfig


@dataclass
class LoopCfg:
    """The training loop (`train.*`): steps, batch sizes, evaluation, checkpoints, logging."""

    max_steps: int = 1000  # optimizer steps in the whole run (the cosine schedule ends here)
    micro_batch_tokens: int = 8192  # token budget of one packed micro-batch (len(batch) · longest ≤ this)
    grad_accum: int = 1  # micro-batches per rank per optimizer step (global batch = world · grad_accum of them)
    eval_every: int = 500  # evaluate on the val split every N steps (0 = only at the end)
    eval_batches: int = 16  # val micro-batches per rank per evaluation (0 = no evaluation)
    save_every: int = 1000  # full checkpoint + head export every N steps (0 = only at the end)
    log_every: int = 10  # log training metrics every N steps
    seed: int = 0  # seeds the head's init, the batch order and the feature noise
    progress: bool = True  # tqdm progress bar on rank 0


@dataclass
class SpecEvalCfg:
    """Speculative decoding on held-out prompts at every evaluation (`spec_eval.*`, rank 0): logs spec/tau."""

    prompts: list[str] = field(default_factory=list)  # conf/data names or prompt files; [] = off
    limit: int = 8  # conversations per prompt set
    k: int = 3  # draft tokens per step
    max_new_tokens: int = 64  # per turn, greedy
    batch_size: int = 8  # concurrent requests


@dataclass
class DeepSpeedCfg:
    """DeepSpeed JSON-config fields (`conf/deepspeed/*.yaml`); "auto" values are filled from the train config."""

    name: str = "zero2"  # short name of this preset (not a DeepSpeed key)
    train_micro_batch_size_per_gpu: Any = 1  # must be 1: a micro-batch is one token-budget packed batch
    gradient_accumulation_steps: Any = "auto"  # auto = train.grad_accum
    gradient_clipping: Any = "auto"  # auto = optim.grad_clip
    bf16: dict[str, Any] = field(default_factory=lambda: {"enabled": "auto"})  # auto = on for CUDA, off (fp32) on CPU
    zero_optimization: dict[str, Any] = field(default_factory=lambda: {"stage": 2})  # ZeRO stage 0, 1 or 2 + knobs
    optimizer: dict[str, Any] = field(default_factory=lambda: {  # AdamW; auto params come from optim.*
        "type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                    "torch_adam": "auto"}})
    steps_per_print: int = 1_000_000_000  # DeepSpeed's own periodic log line: effectively off (we log ourselves)
    wall_clock_breakdown: bool = False  # DeepSpeed's forward/backward/step timers
    extra: dict[str, Any] = field(default_factory=dict)  # any other DeepSpeed keys, passed through unchanged


@dataclass
class WandbCfg:
    """Weights & Biases logging (rank 0 only)."""

    mode: str = "online"  # online | offline | disabled; online falls back to offline when no API key is set
    project: str = "mtp-train"  # W&B project
    entity: str | None = None  # W&B team or user; null = the account's default
    name: str | None = None  # run name; null = W&B picks one
    dir: str | None = None  # where the run's files go; null = the run's `out` folder
    tags: list[str] = field(default_factory=list)  # run tags


@dataclass
class TrainConfig:
    """`mtp-train`: a draft head trained on precomputed target hidden states with DeepSpeed."""

    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadCfg = field(default_factory=HeadCfg)
    data: TrainDataCfg = field(default_factory=TrainDataCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    loss: LossCfg = field(default_factory=LossCfg)
    train: LoopCfg = field(default_factory=LoopCfg)
    deepspeed: DeepSpeedCfg = field(default_factory=DeepSpeedCfg)
    wandb: WandbCfg = field(default_factory=WandbCfg)
    spec_eval: SpecEvalCfg = field(default_factory=SpecEvalCfg)
    out: str = "runs/train"  # run folder: config.yaml, metrics.jsonl, checkpoints/, heads/, wandb/
    resume: str = "auto"  # auto (the latest checkpoint under out, if any) | none | a checkpoint tag folder


# --- checking a composed config ---------------------------------------------------------------------------------
#
# The schemas are in struct mode, but Hydra's `+key=value` adds a key to any config, and a typo without the `+`
# fails inside Hydra with a hint that suggests the `+` form. Both are caught here, naming the nearest valid key:
# `check_overrides` looks at the command line before Hydra composes it, `check_config` at the composed config.

SCHEMAS: dict[str, type] = {
    "precompute": PrecomputeConfig,
    "regenerate": RegenerateConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "export": ExportConfig,
}

# Lower bounds of numeric settings: key → (smallest value, what the key must be). Keys a command does not have
# are not looked at; null stays allowed wherever the schema allows it.
_POSITIVE = "a positive integer"
LOWER_BOUNDS: dict[str, tuple[float, str]] = {
    "limit": (1, "null (everything) or a positive integer"),
    "max_seq_len": (1, _POSITIVE), "shard_tokens": (1, _POSITIVE), "batch_tokens": (1, _POSITIVE),
    "n": (1, _POSITIVE), "max_new_tokens": (1, _POSITIVE), "max_batch_size": (1, _POSITIVE),
    "max_prompt_tokens": (1, _POSITIVE), "batch_size": (1, _POSITIVE), "top_k": (0, "0 (off) or more"),
    "model.page_size": (1, _POSITIVE), "model.tp": (1, _POSITIVE),
    "train.max_steps": (1, "a positive integer (the optimizer steps of the whole run)"),
    "train.micro_batch_tokens": (1, _POSITIVE), "train.grad_accum": (1, _POSITIVE),
    "train.eval_every": (0, "0 (only at the end) or more"), "train.eval_batches": (0, "0 (no evaluation) or more"),
    "train.save_every": (0, "0 (only at the end) or more"), "train.log_every": (1, _POSITIVE),
    "optim.warmup_steps": (0, "0 or more"), "data.num_workers": (0, "0 or more"), "loss.steps": (1, _POSITIVE),
    "spec_eval.limit": (1, _POSITIVE), "spec_eval.k": (1, _POSITIVE), "spec_eval.max_new_tokens": (1, _POSITIVE),
    "spec_eval.batch_size": (1, _POSITIVE),
}


class ConfigError(ValueError):
    """A key the schema does not have, or a value out of range; the message names the key and what to do."""


def _classify(hint: Any) -> tuple[str, Any]:
    """("dataclass", cls) | ("open", None): any sub-key (dicts, Any) | ("list", None) | ("leaf", None)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _classify(args[0]) if len(args) == 1 else ("open", None)
    if hint is Any or origin in (dict, collections.abc.Mapping) or hint is dict:
        return "open", None
    if origin is list or hint is list:
        return "list", None
    if dataclasses.is_dataclass(hint):
        return "dataclass", hint
    return "leaf", None


def _fields(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of `schema` (nested dataclasses expanded), for suggestions."""
    out = []
    for name, hint in _fields(schema).items():
        key = f"{prefix}{name}"
        out.append(key)
        kind, sub = _classify(hint)
        if kind == "dataclass":
            out.extend(schema_keys(sub, key + "."))
    return out


def is_schema_key(schema: type, key: str) -> bool:
    """Whether dotted `key` names a setting of `schema` (anything below a dict-valued setting is one)."""
    parts = key.split(".")
    node: Any = schema
    for i, part in enumerate(parts):
        hints = _fields(node)
        if part not in hints:
            return False
        kind, sub = _classify(hints[part])
        rest = parts[i + 1:]
        if kind == "open" or not rest:
            return True
        if kind == "list":
            return len(rest) == 1 and rest[0].isdigit()
        if kind == "leaf":
            return False
        node = sub
    return True


def unknown_key_error(schema: type, key: str, name: str) -> ConfigError:
    """The error for `key`, which `schema` lacks: names the nearest valid key (difflib), or the valid ones."""
    valid = schema_keys(schema)
    parent = key
    while "." in parent:  # the deepest part of the key that does name a group of settings (train, data.…)
        parent = parent.rsplit(".", 1)[0]
        if any(k.startswith(parent + ".") for k in valid):
            break
    else:
        parent = ""
    prefix = parent + "." if parent else ""
    near = difflib.get_close_matches(key, [k for k in valid if k.startswith(prefix)], n=1, cutoff=0.6)
    if near:
        hint = f"did you mean `{near[0]}`?"
    else:
        children = sorted(k[len(prefix):] for k in valid if k.startswith(prefix) and "." not in k[len(prefix):])
        hint = f"the keys{' under `' + parent + '`' if parent else ''} are: {', '.join(children)}"
    return ConfigError(f"unknown config key `{key}` (conf/{name}.yaml's schema has no such setting); {hint}")


def _flat_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of a composed config, not descending below settings whose values are dicts."""
    out = []
    hints = _fields(schema)
    for k in node:
        key = f"{prefix}{k}"
        if k not in hints:
            out.append(key)
            continue
        kind, sub = _classify(hints[k])
        value = node[k]
        if kind == "dataclass" and hasattr(value, "keys"):
            out.extend(_flat_keys(value, sub, key + "."))
        else:
            out.append(key)
    return out


def check_config(cfg: Any, name: str) -> Any:
    """Refuse a composed config of command `name` with a key its schema lacks or a value out of range; return it.

    `+key=value` on the command line adds keys that the schema does not have (Hydra allows it); they would be
    ignored, so a mistyped setting would silently keep its default.
    """
    schema = SCHEMAS[name]
    for key in _flat_keys(cfg, schema):
        if not is_schema_key(schema, key):
            raise unknown_key_error(schema, key, name)
    for key, (low, what) in LOWER_BOUNDS.items():
        node, parts = cfg, key.split(".")
        for part in parts:
            node = node.get(part) if hasattr(node, "get") else None
            if node is None:
                break
        if isinstance(node, (int, float)) and not isinstance(node, bool) and node < low:
            raise ConfigError(f"{key}={node} is out of range: `{key}` must be {what}")
    return cfg


def check_overrides(overrides: list[str], name: str) -> None:
    """Refuse command-line overrides naming a key or a config-group choice that command `name` does not have.

    Run before Hydra composes: Hydra's own error for a typo suggests adding the key with `+`, which would only
    make the typo silent. Overrides of Hydra's own settings (`hydra.*`, `hydra/...`) are left to Hydra.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    schema = SCHEMAS[name]
    conf = Path(CONF_DIR)
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.key_or_group
        if o.is_delete() or o.package or key.startswith("hydra") or "/" in key:
            continue
        group = conf / key
        if "." not in key and group.is_dir():
            value = o.value()
            if isinstance(value, str) and not (group / f"{value}.yaml").is_file():
                choices = sorted(p.stem for p in group.glob("*.yaml"))
                near = difflib.get_close_matches(value, choices, n=1)
                hint = f"did you mean `{key}={near[0]}`? " if near else ""
                raise ConfigError(f"`{key}={value}`: there is no conf/{key}/{value}.yaml; {hint}"
                                  f"choose one of {', '.join(choices)}")
            continue
        if not is_schema_key(schema, key):
            raise unknown_key_error(schema, key, name)
