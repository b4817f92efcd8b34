"""Measure speculative decoding by running it: acceptance, τ, draft/verify time and speed-up against `none`.

For every prompt set, temperature and (method, k) of the grid, the prompts are answered turn by turn (MT-bench's
second question follows the model's own first answer) by a `SpecEngine`, and once per prompt set and temperature
by the plain `LLMEngine` (`none`), in the same process, so the speed-up is ours over ours on the same prompts.
At temperature 0 the speculative answers must equal the plain answers; the share that does is reported as
`exact_match` (1.0 unless a floating-point near-tie flipped an argmax).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mtp_train.data.chat import render
from mtp_train.data.readers import Conversation
from mtp_train.engine.llm import GenerationOutput, LLMEngine
from mtp_train.engine.sampling import SamplingParams
from mtp_train.models.base import CausalLM
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.metrics import SpecMetrics
from mtp_train.speculative.proposers import Proposer


@dataclass
class PromptSet:
    """A named list of conversations whose user turns are the prompts (assistant turns are ignored)."""

    name: str
    convs: list[Conversation]


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


def user_turns(conv: Conversation) -> tuple[list[dict[str, str]], list[str]]:
    """(leading system messages, the user turns' contents) of a conversation."""
    system = [m for m in conv.messages if m["role"] == "system"]
    return system, [m["content"] for m in conv.messages if m["role"] == "user"]


def answer(generate: Callable[[list[list[int]], SamplingParams], list[GenerationOutput]], tokenizer: Any,
           convs: Sequence[Conversation], params: SamplingParams,
           template_kwargs: Mapping[str, Any] | None = None) -> list[list[GenerationOutput]]:
    """Answer every user turn of every conversation, turn by turn, each turn after the model's own answers.

    generate(prompts, params) runs one batch of requests (token ids) and returns outputs in order.
    """
    history = []
    turns = []
    for c in convs:
        system, users = user_turns(c)
        history.append(list(system))
        turns.append(users)
    results: list[list[GenerationOutput]] = [[] for _ in convs]
    for t in range(max((len(u) for u in turns), default=0)):
        active = [i for i, u in enumerate(turns) if len(u) > t]
        prompts = []
        for i in active:
            history[i].append({"role": "user", "content": turns[i][t]})
            text = render(tokenizer, history[i], add_generation_prompt=True, template_kwargs=template_kwargs)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        outs = generate(prompts, params)
        for i, out in zip(active, outs):
            results[i].append(out)
            history[i].append({"role": "assistant",
                               "content": tokenizer.decode(out.output_ids, skip_special_tokens=True)})
    return results


def _run(engine: LLMEngine, prompt_set: PromptSet, tokenizer: Any, params: SamplingParams, method: str, k: int,
         template_kwargs: Mapping[str, Any] | None, progress: bool) -> RunResult:
    def generate(prompts: list[list[int]], p: SamplingParams) -> list[GenerationOutput]:
        return engine.generate(prompts, p, progress=progress)

    answers = answer(generate, tokenizer, prompt_set.convs, params, template_kwargs)
    st = engine.stats
    res = RunResult(prompt_set.name, method, k, params.temperature, answers, st.generated_tokens, st.seconds)
    if isinstance(engine, SpecEngine):
        res.metrics = engine.stats.metrics
        res.split = {"prefill_seconds": engine.stats.prefill_seconds, "draft_seconds": engine.stats.draft_seconds,
                     "verify_seconds": engine.stats.verify_seconds, "update_seconds": engine.stats.update_seconds}
    return res


def exact_match(a: RunResult, b: RunResult) -> float:
    """Share of conversations whose every turn's tokens are identical in both runs."""
    same = [[o.output_ids for o in x] == [o.output_ids for o in y] for x, y in zip(a.answers, b.answers)]
    return sum(same) / len(same) if same else 1.0


@dataclass
class EvalSettings:
    """The grid and the decoding settings of an evaluation."""

    ks: list[int]
    temperatures: list[float]
    max_new_tokens: int = 256
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 1  # concurrent requests; 1 measures per-request latency, what speculation is for
    page_size: int = 16
    kv_cache_gb: float = 1.0
    stop_token_ids: list[int] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    warmup: bool = True  # one short untimed generation per engine first (allocations, pre-packing)
    progress: bool = False


def evaluate(target: CausalLM, tokenizer: Any, prompt_sets: Sequence[PromptSet],
             methods: Sequence[Method], s: EvalSettings,
             on_result: Callable[[RunResult, RunResult], None] | None = None,
             ) -> tuple[list[tuple[RunResult, RunResult]], list[RunResult]]:
    """Run the grid: per prompt set and temperature, `none` once, then every method × k of `methods`.

    Each method makes a fresh proposer per engine (its state is per engine). Returns the (run, baseline) pairs in
    order and the baseline runs; on_result(run, baseline) is called after each run.
    """
    engine_kw = {"page_size": s.page_size, "kv_cache_gb": s.kv_cache_gb, "max_batch_size": s.batch_size}

    def params(temp: float) -> SamplingParams:
        return SamplingParams(temperature=temp, top_k=s.top_k, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                              seed=s.seed, stop_token_ids=None if s.stop_token_ids is None else list(s.stop_token_ids))

    def warm(engine: LLMEngine) -> None:
        if s.warmup:
            engine.generate([[int(t) for t in tokenizer("Hello", add_special_tokens=False)["input_ids"]]],
                            SamplingParams(max_new_tokens=4, ignore_eos=True))
            engine.reset_stats()  # measure the real run only

    pairs: list[tuple[RunResult, RunResult]] = []
    baselines: list[RunResult] = []
    for ps in prompt_sets:
        for temp in s.temperatures:
            base_engine = LLMEngine(target, **engine_kw)
            warm(base_engine)
            base = _run(base_engine, ps, tokenizer, params(temp), "none", 0, s.template_kwargs, s.progress)
            del base_engine
            baselines.append(base)
            for method in methods:
                for k in s.ks:
                    engine = SpecEngine(target, method.make(), k, **engine_kw)
                    warm(engine)
                    run = _run(engine, ps, tokenizer, params(temp), method.name, k, s.template_kwargs,
                               s.progress)
                    run.options = dict(method.options)
                    del engine
                    pairs.append((run, base))
                    if on_result is not None:
                        on_result(run, base)
    return pairs, baselines


def result_row(run: RunResult, base: RunResult) -> dict[str, Any]:
    """The report row of one run against its baseline."""
    m = run.metrics
    row: dict[str, Any] = {
        "dataset": run.dataset, "method": run.method, "k": run.k, "temperature": run.temperature, **run.options,
        "prompts": len(run.answers), "generated_tokens": run.generated_tokens, "seconds": run.seconds,
        "tokens_per_s": run.tokens_per_s, "baseline_tokens_per_s": base.tokens_per_s,
        "speedup": run.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else 0.0,
        **run.split,
    }
    if m is not None:
        row.update(metric_fields(m))
        row["step_cost"] = step_cost(row)
    if run.temperature == 0:
        row["exact_match"] = exact_match(run, base)
    return row


def metric_fields(m: SpecMetrics) -> dict[str, Any]:
    """A report row's speculative columns (τ, acceptance, per-position, counts, drafts verified per step)."""
    return {"tau": m.mean_acceptance_length, "acceptance_rate": m.acceptance_rate, "per_position": m.per_position,
            "num_drafts": m.num_drafts, "num_accepted": m.num_accepted, "mean_draft_len": m.mean_draft_length,
            "num_empty": m.num_empty}


def step_cost(row: Mapping[str, Any]) -> float | None:
    """What one speculative step (draft → verify → catch-up) cost, in plain decode steps: τ / speed-up.

    Speed-up = τ / step cost, so this is also the break-even τ on this machine, and τ_x / step_cost predicts the
    speed-up of a head reaching τ_x with the same k (the step's cost barely depends on what gets accepted).
    """
    tau, speedup = row.get("tau"), row.get("speedup")
    return tau / speedup if tau is not None and speedup else None


def overall_rows(pairs: Sequence[tuple[RunResult, RunResult]]) -> list[dict[str, Any]]:
    """Per (method and options, k, temperature), all prompt sets together: counts summed, tokens/s over the summed
    time."""
    groups: dict[tuple[str, tuple, int, float], list[tuple[RunResult, RunResult]]] = {}
    for run, base in pairs:
        key = (run.method, tuple(sorted(run.options.items())), run.k, run.temperature)
        groups.setdefault(key, []).append((run, base))
    rows = []
    for (method, options, k, temp), items in groups.items():
        m = SpecMetrics(k)
        for run, _ in items:
            if run.metrics is not None:
                m.merge(run.metrics)
        tokens = sum(r.generated_tokens for r, _ in items)
        secs = sum(r.seconds for r, _ in items)
        btokens = sum(b.generated_tokens for _, b in items)
        bsecs = sum(b.seconds for _, b in items)
        tps, btps = tokens / secs if secs else 0.0, btokens / bsecs if bsecs else 0.0
        row: dict[str, Any] = {
            "dataset": "overall", "method": method, "k": k, "temperature": temp, **dict(options),
            "prompts": sum(len(r.answers) for r, _ in items), "generated_tokens": tokens, "seconds": secs,
            "tokens_per_s": tps, "baseline_tokens_per_s": btps, "speedup": tps / btps if btps else 0.0,
            **metric_fields(m),
        }
        row["step_cost"] = step_cost(row)
        for key in ("prefill_seconds", "draft_seconds", "verify_seconds", "update_seconds"):
            row[key] = sum(r.split.get(key, 0.0) for r, _ in items)
        if temp == 0:
            n = sum(len(r.answers) for r, _ in items)
            row["exact_match"] = sum(exact_match(r, b) * len(r.answers) for r, b in items) / max(n, 1)
        rows.append(row)
    return rows


def attach_ngram(rows: Sequence[dict[str, Any]]) -> None:
    """Give every row of another method `tau_ngram` and `speedup_ngram`: prompt lookup's on the same prompt set, k
    and temperature of the same run (when it ran), the floor a trained drafter has to clear."""
    floor = {(r["dataset"], r["k"], r["temperature"]): r for r in rows if r["method"] == "ngram"}
    for r in rows:
        ng = floor.get((r["dataset"], r["k"], r["temperature"]))
        if r["method"] != "ngram" and ng is not None:
            r["tau_ngram"], r["speedup_ngram"] = ng.get("tau"), ng["speedup"]


def best_row(rows: Sequence[Mapping[str, Any]], temperature: float = 0.0) -> Mapping[str, Any] | None:
    """The overall row with the highest speed-up at `temperature` (None when there is none); prompt lookup's rows
    only when no other method ran (it is the comparison, not the candidate)."""
    cands = [r for r in rows if r["dataset"] == "overall" and r["temperature"] == temperature]
    drafters = [r for r in cands if r["method"] != "ngram"]
    cands = drafters or cands
    return max(cands, key=lambda r: r["speedup"]) if cands else None


@torch.inference_mode()
def head_acceptance(target: CausalLM, tokenizer: Any, proposer: Callable[[], Proposer],
                    convs: Sequence[Conversation], k: int, max_new_tokens: int, *, page_size: int = 16,
                    batch_size: int = 8, stop_token_ids: list[int] | None = None) -> dict[str, float]:
    """τ, acceptance rate and per-position acceptance of a head on held-out prompts, greedy (training validation).

    No baseline, no timing: the speculative path only, batched.
    """
    t0 = time.perf_counter()
    engine = SpecEngine(target, proposer(), k, page_size=page_size, max_batch_size=batch_size,
                        kv_cache_gb=0.25)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    answer(lambda p, sp: engine.generate(p, sp), tokenizer, convs, params)
    m = engine.stats.metrics
    out = {"spec/tau": m.mean_acceptance_length, "spec/acceptance_rate": m.acceptance_rate,
           "spec/seconds": time.perf_counter() - t0}
    out.update({f"spec/pos{j}": a for j, a in enumerate(m.per_position)})
    return out
