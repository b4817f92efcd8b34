"""`mtp-eval`: speculative decoding on held-out prompts, against plain decoding in the same run."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from mtp_train.config.errors import ConfigError
from mtp_train.config.model import ModelConfig
from mtp_train.config.vllm import VllmEngineConfig

GRID_AXES = ("k", "draft_threshold", "catch_up", "draft_width", "tree", "temperature")  # a value or a list each
GRID_KINDS: dict[str, type] = {"k": int, "draft_threshold": float, "catch_up": str, "draft_width": int, "tree": str,
                               "temperature": float}
TREE_SHAPE = re.compile(r"none|\d+x\d+x\d+")  # `tree` values: none (a chain / draft_width) or STEPSxTOPKxTOKENS
EVAL_BACKENDS = ("engine", "vllm")  # who runs the speculative decoding mtp-eval measures (`backend`)
# An old `method` name → the method that replaced it: said once (a FutureWarning naming the new one), then run as it.
RENAMED_METHODS = {"mtp": "head"}  # `mtp` is a head type; method=head runs a trained head of any type
HEAD_WEIGHTS = ("bf16", "int8", "fp32")  # what a head's few-row CPU products stream (`head_weights`)


def check_head_weights(value: str) -> None:
    """`head_weights` is one of HEAD_WEIGHTS (else a ConfigError naming the key)."""
    if value not in HEAD_WEIGHTS:
        raise ConfigError(f"head_weights={value!r}: choose one of {' | '.join(HEAD_WEIGHTS)}")


@dataclass
class NgramConfig:
    """Prompt lookup (training-free n-gram drafting) in `mtp-eval`: the floor a trained drafter must clear."""

    compare: bool = True  # also run prompt lookup at every k on the same prompts (rows method=ngram, tau_ngram)
    n_max: int = 3  # longest suffix tried first
    n_min: int = 1  # shortest suffix that still counts as a match


@dataclass
class VllmEvalConfig(VllmEngineConfig):
    """`backend=vllm`: the vLLM engine mtp-eval launches to run the exported head (VllmEngineConfig's settings and
    its context)."""

    max_model_len: int | None = None  # the context vLLM reserves per sequence (null: the target's own)


@dataclass
class EvalConfig:
    """`mtp-eval`: speculative decoding on held-out prompts, against plain decoding in the same run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    # head (a trained head of any type, drafting with its type's drafter) | draft (a small model) | ngram (prompt
    # lookup) | none (plain only): the methods registered in mtp_train.eval.methods, each multiplied only by the
    # axes of GRID_AXES it has (the head's: those its drafter takes); mtp is a deprecated name of head
    method: str = "head"
    head_ckpt: str | None = None  # head folder (mtp-train's heads/step-N or an mtp-export native folder)
    draft_model: str | None = None  # Hugging Face folder of the draft model (method=draft), same tokenizer
    prompts: list[str] = field(default_factory=lambda: ["demo-heldout"])  # conf/data names or prompt files
    k: Any = 4  # draft tokens per step (the most, with a threshold): an int or a list (a grid)
    draft_threshold: Any = 0.0  # head: stop a chain before a draft with top-1 prob below it; a float or a list
    catch_up: Any = "target"  # chain heads: after verification re-run accepted rows on the target's h | own; a list
    # chain heads: candidates at the first draft position (the head's top w; the top one carries the chain, the
    # others are verified beside it in one tree step); an int or a list
    draft_width: Any = 1
    tree: Any = "none"  # head: a dynamic draft tree STEPSxTOPKxTOKENS (SGLang's speculative_num_steps /
    # speculative_eagle_topk / speculative_num_draft_tokens, the root counted), e.g. 3x4x8, or none; or a list. A
    # tree's point runs at k = STEPS whatever `k` says (the k axis multiplies only the chains)
    # head, on CPU in float32: bf16 (the head's few-row products stream a bfloat16 copy of its weights, half the
    # bytes; a draft may change, never an answer: the target verifies every token) | int8 (int8 rows with a scale
    # each, a quarter) | fp32 (its own weights)
    head_weights: str = "bf16"
    ngram: NgramConfig = field(default_factory=NgramConfig)
    temperature: Any = 0.0  # a float or a list (a grid); 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # request i of a turn is seeded seed + i
    max_new_tokens: int = 256  # per turn
    limit: int | None = None  # first N conversations of each prompt set
    batch_size: int = 1  # concurrent requests (1 = per-request latency, what speculation is for); also the chunk
    # of conversations every engine answers in turn (the baseline's and the methods' times interleave)
    repeats: int = 1  # answer every prompt set this many times over (interleaved again): more timing, same answers
    warmup: bool = True  # one short untimed generation per engine first (it also captures the CUDA graphs)
    cuda_graphs: bool | None = None  # decode / verify / draft steps as CUDA graphs; null = where they run (CUDA +
    # flashinfer), false = eager everywhere
    verify_fingerprint: bool = True  # refuse a head trained for other target weights
    out: str = "runs/eval"  # report.json, report.md, outputs.jsonl, *.png
    # replace the report of an evaluation of other settings in `out`, remove links there that lead outside it
    # (else both are refused by name)
    overwrite: bool = False
    plots: bool = True
    progress: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # engine (ours, in this process) | vllm (the head exported as format=speculators and run by a vLLM it launches:
    # one grid point, τ and acceptance from vLLM's counters; the way to measure a head for a target our engine does
    # not implement; docs/serving.md)
    backend: str = "engine"
    vllm_python: str = ".venv-vllm/bin/python"  # backend=vllm: the python of vLLM's environment
    vllm: VllmEvalConfig = field(default_factory=VllmEvalConfig)  # backend=vllm: its engine settings

    def __post_init__(self) -> None:
        if self.method in RENAMED_METHODS:
            new = RENAMED_METHODS[self.method]
            # FutureWarning: shown to users by default, once per run (Python's default filter)
            warnings.warn(f"method={self.method} is deprecated: use method={new} (it runs any trained head with its "
                          f"head type's drafter; {self.method} names a head type); running method={new}",
                          FutureWarning, stacklevel=2)
            self.method = new
        if not self.prompts:  # nothing to measure: the run would only replace a report with an empty one
            raise ConfigError("prompts=[] names no prompt set: mtp-eval measures on prompts; give one or more, e.g. "
                              "prompts=[demo-heldout] or prompts=[data/my_prompts.jsonl]")
        for axis in GRID_AXES:
            self.grid(axis)  # a value of the wrong kind, or an empty list, fails here
        bad = [t for t in self.grid("tree") if not TREE_SHAPE.fullmatch(t)]
        if bad:
            raise ConfigError(f"tree must be none or STEPSxTOPKxTOKENS (e.g. 3x4x8), got {bad}")
        ks = self.grid("k")
        if any(k < 1 for k in ks):
            raise ConfigError(f"k must be >= 1, got {ks}")
        if self.repeats < 1 or self.batch_size < 1:
            raise ConfigError(f"repeats and batch_size must be >= 1, got {self.repeats} and {self.batch_size}")
        check_head_weights(self.head_weights)
        if self.backend not in EVAL_BACKENDS:
            raise ConfigError(f"backend={self.backend!r}: choose one of {' | '.join(EVAL_BACKENDS)}")

    def grid(self, axis: str) -> list[Any]:
        """The values of grid setting `axis` (one of GRID_AXES) as a non-empty list of its kind (GRID_KINDS):
        `k=3` → [3], `k=[1,2]` → [1, 2], `temperature=[0,1]` → [0.0, 1.0]."""
        value, kind = getattr(self, axis), GRID_KINDS[axis]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values:
            raise ConfigError(f"`{axis}` is empty")
        try:
            return [kind(v) for v in values]
        except (TypeError, ValueError):
            raise ConfigError(f"`{axis}` must be a {kind.__name__} or a list of them, got {value!r}") from None
