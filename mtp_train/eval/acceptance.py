"""Measure speculative decoding by running it: acceptance, τ, draft/verify time and speed-up against `none`.

For every prompt set, temperature and (method, k) of the grid, the prompts are answered turn by turn (MT-bench's
second question follows the model's own first answer; `mtp_train.engine.turns`, the loop and special-token rule
regeneration uses too) by a `SpecEngine`, and once per prompt set and temperature by the plain `LLMEngine`
(`none`), in the same process, so the speed-up is ours over ours on the same prompts. At temperature 0 the
speculative answers must equal the plain answers; the share that does is reported as `exact_match` (1.0 unless a
floating-point near-tie flipped an argmax). The report's rows are made in `mtp_train.eval.rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtp_train.config import EvalConfig
from mtp_train.data.prompts import PromptSet
from mtp_train.engine.llm import GenerationOutput, LLMEngine
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import answer
from mtp_train.models.base import CausalLM
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.metrics import SpecMetrics
from mtp_train.speculative.proposers import Proposer


@dataclass
class Method:
    """One speculative method of the grid: a name, a factory of fresh proposers and the options that set it."""

    name: str  # mtp | draft | ngram
    make: Callable[[], Proposer]
    options: dict[str, Any] = field(default_factory=dict)  # e.g. {"draft_threshold": 0.5, "catch_up": "own"}


@dataclass
class RunResult:
    """One (prompt set, method and options, k, temperature) run."""

    dataset: str
    method: str
    k: int
    temperature: float
    answers: list[list[GenerationOutput]]  # per conversation, per user turn
    generated_tokens: int
    seconds: float
    metrics: SpecMetrics | None = None  # None for `none`
    split: dict[str, float] = field(default_factory=dict)  # prefill / draft / verify / update seconds
    options: dict[str, Any] = field(default_factory=dict)  # the method's options (Method.options)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def _run(engine: LLMEngine, prompt_set: PromptSet, tokenizer: Any, params: SamplingParams, method: str, k: int,
         template_kwargs: Mapping[str, Any] | None, progress: bool) -> RunResult:
    answers = answer(engine, tokenizer, prompt_set.convs, params, template_kwargs, progress)
    st = engine.stats
    res = RunResult(prompt_set.name, method, k, params.temperature, answers, st.generated_tokens, st.seconds)
    if isinstance(engine, SpecEngine):
        res.metrics = engine.stats.metrics
        res.split = {"prefill_seconds": engine.stats.prefill_seconds, "draft_seconds": engine.stats.draft_seconds,
                     "verify_seconds": engine.stats.verify_seconds, "update_seconds": engine.stats.update_seconds}
    return res


def evaluate(target: CausalLM, tokenizer: Any, prompt_sets: Sequence[PromptSet],
             methods: Sequence[Method], cfg: EvalConfig, *, stop_ids: Sequence[int] | None,
             on_result: Callable[[RunResult, RunResult], None] | None = None,
             ) -> tuple[list[tuple[RunResult, RunResult]], list[RunResult]]:
    """Run the grid: per prompt set and temperature, `none` once, then every method × k of `methods`.

    From `cfg`: the grid axes k and temperature (`cfg.grid`), the decoding settings (max_new_tokens, top_k, top_p,
    seed), batch_size, warmup, progress, chat_template_kwargs and the engine's page_size / kv_cache_gb
    (`cfg.model`); `stop_ids` end every answer (None: the model's EOS ids). Each method makes a fresh proposer per
    engine (its state is per engine). Returns the (run, baseline) pairs in order and the baseline runs;
    on_result(run, baseline) is called after each run.
    """
    engine_kw = {"page_size": cfg.model.page_size, "kv_cache_gb": cfg.model.kv_cache_gb,
                 "max_batch_size": cfg.batch_size, "cuda_graphs": cfg.cuda_graphs}
    template_kwargs = cfg.chat_template_kwargs

    def params(temp: float) -> SamplingParams:
        return SamplingParams(temperature=temp, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              seed=cfg.seed, stop_token_ids=None if stop_ids is None else list(stop_ids))

    def warm(engine: LLMEngine) -> None:
        if cfg.warmup:
            engine.generate([[int(t) for t in tokenizer("Hello", add_special_tokens=False)["input_ids"]]],
                            SamplingParams(max_new_tokens=4, ignore_eos=True))
            engine.reset_stats()  # measure the real run only

    pairs: list[tuple[RunResult, RunResult]] = []
    baselines: list[RunResult] = []
    for ps in prompt_sets:
        for temp in cfg.grid("temperature"):
            base_engine = LLMEngine(target, **engine_kw)
            warm(base_engine)
            base = _run(base_engine, ps, tokenizer, params(temp), "none", 0, template_kwargs, cfg.progress)
            del base_engine
            baselines.append(base)
            for method in methods:
                for k in cfg.grid("k"):
                    engine = SpecEngine(target, method.make(), k, **engine_kw)
                    warm(engine)
                    run = _run(engine, ps, tokenizer, params(temp), method.name, k, template_kwargs, cfg.progress)
                    run.options = dict(method.options)
                    del engine
                    pairs.append((run, base))
                    if on_result is not None:
                        on_result(run, base)
    return pairs, baselines
