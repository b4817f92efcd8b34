"""Measure speculative decoding by running it: acceptance, τ, draft/verify time and speed-up against `none`.

For every prompt set and point of the grid (`mtp_train.eval.options`: a method and the values of its axes), the
prompts are answered turn by turn (MT-bench's second question follows the model's own first answer;
`mtp_train.engine.turns`, the loop and special-token rule regeneration uses too) by a `SpecEngine`, and per prompt
set and temperature by the plain `LLMEngine` (`none`), in the same process, so the speed-up is ours over ours on
the same prompts. The engines take turns chunk by chunk (`evaluate`): a machine whose speed drifts over minutes
slows the baseline and the methods alike. At temperature 0 the speculative answers must equal the plain answers;
the share that does is reported as `exact_match` (1.0 unless a floating-point near-tie flipped an argmax). The
report's rows are made in `mtp_train.eval.rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from mtp_train.config import EvalConfig
from mtp_train.data.prompts import PromptSet
from mtp_train.engine.llm import GenerationOutput, LLMEngine
from mtp_train.engine.runner import kv_pool
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import answer
from mtp_train.eval.methods import MethodSet
from mtp_train.eval.options import EvalPoint
from mtp_train.models.base import CausalLM
from mtp_train.speculative.engine import SpecEngine, SpecStats
from mtp_train.speculative.metrics import SpecMetrics


@dataclass
class RunResult:
    """One (prompt set, grid point) run."""

    dataset: str
    point: EvalPoint
    answers: list[list[GenerationOutput]] = field(default_factory=list)  # per conversation, per user turn (the
    # first repeat's)
    generated_tokens: int = 0  # over all repeats
    seconds: float = 0.0  # decoding time over all repeats
    metrics: SpecMetrics | None = None  # None for plain decoding
    split: dict[str, float] = field(default_factory=dict)  # prefill / draft / verify / update seconds
    chunks: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) per chunk of conversations,
    # in the order they ran (repeats one after another); chunk i of every run of a prompt set holds the same prompts

    @property
    def method(self) -> str:
        return self.point.method

    @property
    def k(self) -> int:
        return self.point.k

    @property
    def temperature(self) -> float:
        return self.point.temperature

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def collect(self, engine: LLMEngine) -> None:
        """Take the totals (and for a `SpecEngine` the counters and time split) of the engine that made this run."""
        st = engine.stats
        self.generated_tokens, self.seconds = st.generated_tokens, st.seconds
        if isinstance(st, SpecStats):
            self.metrics = st.metrics
            self.split = {"prefill_seconds": st.prefill_seconds, "draft_seconds": st.draft_seconds,
                          "verify_seconds": st.verify_seconds, "update_seconds": st.update_seconds}


def evaluate(target: CausalLM, tokenizer: Any, prompt_sets: Sequence[PromptSet], points: Sequence[EvalPoint],
             methods: MethodSet, cfg: EvalConfig, *, stop_ids: Sequence[int] | None,
             on_result: Callable[[RunResult, RunResult], None] | None = None,
             ) -> tuple[list[tuple[RunResult, RunResult]], list[RunResult]]:
    """Run the grid: per prompt set and temperature, the plain point and every other point of `points` (the
    grid as `mtp_train.eval.options.expand_grid` lays it out), interleaved.

    `methods` builds each point's proposer (`MethodSet.proposer`: a fresh one per engine, its state is per
    engine; none for the plain baseline, which every temperature of `points` must have). From `cfg`: the
    decoding settings (max_new_tokens, top_k, top_p, seed), batch_size, repeats, warmup, progress,
    chat_template_kwargs and the engine's page_size / kv_cache_gb (`cfg.model`); `stop_ids` end every answer
    (None: the model's EOS ids). Every engine of a prompt set and temperature is built (and warmed) first; then
    the conversations go in chunks of batch_size, and every chunk is answered by each engine in turn, the order
    rotating from chunk to chunk, `repeats` times over. So the baseline's time and each method's are taken
    minutes, not a whole run, apart, and a machine whose speed drifts (thermal or other load) moves both alike;
    the chunk pairs give the speed-up's interval (`mtp_train.eval.rows`).
    Returns the (run, baseline) pairs in order and the baseline runs; on_result(run, baseline) is called after
    each prompt set and temperature.
    """
    # One page pool for all engines (they take turns, and every chunk gives its pages back): the grid costs the
    # memory of one engine's cache, plus each head's one-layer pool.
    kv = kv_pool(target, page_size=cfg.model.page_size, kv_cache_gb=cfg.model.kv_cache_gb)
    engine_kw = {"kv": kv, "max_batch_size": cfg.batch_size, "cuda_graphs": cfg.cuda_graphs}
    template_kwargs = cfg.chat_template_kwargs

    def params(temp: float, offset: int) -> SamplingParams:
        # Conversation j of a prompt set is seeded seed + j, whichever chunk it is answered in.
        return SamplingParams(temperature=temp, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              seed=cfg.seed + offset, stop_token_ids=None if stop_ids is None else list(stop_ids))

    def warm(engine: LLMEngine) -> LLMEngine:
        if cfg.warmup:
            engine.generate([[int(t) for t in tokenizer("Hello", add_special_tokens=False)["input_ids"]]],
                            SamplingParams(max_new_tokens=4, ignore_eos=True))
        engine.reset_stats()  # measure the real run only
        return engine

    pairs: list[tuple[RunResult, RunResult]] = []
    baselines: list[RunResult] = []
    by_temp: dict[float, list[EvalPoint]] = {}
    for p in points:
        by_temp.setdefault(p.temperature, []).append(p)
    for temp, at in by_temp.items():
        plain = [p for p in at if p.spec.plain]
        if len(plain) != 1:
            raise ValueError(f"the grid needs one plain baseline at temperature {temp:g}, got {len(plain)}")
        by_temp[temp] = plain + [p for p in at if not p.spec.plain]  # the baseline's run first
    for ps in prompt_sets:
        for temp, at in by_temp.items():
            runs = [RunResult(ps.name, p) for p in at]
            engines = [warm(_engine(target, methods, p, engine_kw)) for p in at]
            _interleave(ps, engines, runs, tokenizer, lambda o, t=temp: params(t, o), cfg.batch_size, cfg.repeats,
                        template_kwargs, cfg.progress)
            for run, engine in zip(runs, engines):
                run.collect(engine)
            del engines
            base = runs[0]
            baselines.append(base)
            for run in runs[1:]:
                pairs.append((run, base))
                if on_result is not None:
                    on_result(run, base)
    return pairs, baselines


def _engine(target: CausalLM, methods: MethodSet, point: EvalPoint, engine_kw: Mapping[str, Any]) -> LLMEngine:
    """The engine of one point: the plain one, or a `SpecEngine` with a fresh proposer of the point's method."""
    proposer = methods.proposer(point)
    if proposer is None:
        return LLMEngine(target, **engine_kw)
    return SpecEngine(target, proposer, point.k, **engine_kw)


def _interleave(ps: PromptSet, engines: Sequence[LLMEngine], runs: Sequence[RunResult], tokenizer: Any,
                params: Callable[[int], SamplingParams], batch_size: int, repeats: int,
                template_kwargs: Mapping[str, Any] | None, progress: bool) -> None:
    """Answer `ps` with every engine, chunk by chunk (see `evaluate`); the answers of the first repeat and every
    chunk's (tokens, seconds) go into `runs` (one per engine)."""
    starts = list(range(0, len(ps.convs), max(1, batch_size)))
    bar = tqdm(total=repeats * len(starts) * len(engines), desc=f"{ps.name} (chunks x engines)", disable=not progress,
               leave=False)
    for rep in range(repeats):
        for c, start in enumerate(starts):
            convs = ps.convs[start:start + batch_size]
            shift = (rep * len(starts) + c) % len(engines)  # who goes first rotates
            for e in [*range(shift, len(engines)), *range(shift)]:
                engine, run = engines[e], runs[e]
                tokens, seconds = engine.stats.generated_tokens, engine.stats.seconds
                got = answer(engine, tokenizer, convs, params(start), template_kwargs)
                run.chunks.append((engine.stats.generated_tokens - tokens, engine.stats.seconds - seconds))
                if rep == 0:
                    run.answers.extend(got)
                bar.update(1)
    bar.close()
