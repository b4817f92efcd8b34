"""Where a speculative step goes: each part of one engine step, in milliseconds and as a share of a plain decode step.

For plain decoding and each speculative row (a head's chain at k = 1..4, draft width 2, a dynamic tree, prompt
lookup), batch-1 greedy generation of the same prompts, every step broken down into:

- schedule: the scheduler's admission and page growth; postprocess: appending the tokens, stop rules;
- draft: the proposer's drafting (`propose`); head_update: its catch-up after verification (`update`);
- layout: the verify rows (tree layout, slots, positions); verify (or decode) forward, split by layer kind:
  linear (every projection but the lm_head), attention (the backend's kernels and its per-step `prepare`), norm,
  lm_head, other (embedding, RoPE, activations, residuals: the forward's remainder);
- accept: sampling / acceptance on the logits; kv_commit: moving an accepted path's K/V into place;
- python: the rest of `engine.step()` between those parts.

Each part is printed in ms per step and as a ratio to the plain step's total, beside `step_cost` (a speculative
step in plain decode steps) and the floor: the same forward over one row (the plain step's forward). Timings
come from hooks around the parts (a few µs each), so read the shares, not the last decimal.

Usage: python -m bench.step --model models/smollm2-135m-instruct [--head runs/demo/train/heads/step-600]
       [--limit 4] [--max-new-tokens 64] [--ks 1,2,3,4]
Without --head an untrained mtp head (the target's last layer, the demo's 8k draft vocabulary) drafts: its
acceptance is low, its costs are the demo head's. Measure on a quiet machine: one competing process changes every
figure. The last line printed is one JSON object.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bench.common import head_proposer, parser, report
from mtp_train.engine import LLMEngine, SamplingParams

FORWARD_PARTS = ("linear", "attention", "norm", "lm_head", "other")
STEP_PARTS = ("schedule", "draft", "layout", "forward", "accept", "kv_commit", "postprocess", "head_update", "python")


class Timers:
    """Seconds per named part, accumulated over the steps of one run; `part(name)` times a block, re-entrantly
    (a part inside another counts for both: the forward's parts are also inside `forward`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time every call of `owner.attr` (a bound method or a module-level function) as `name`."""
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.part(name):
                return fn(*args, **kwargs)

        setattr(owner, attr, timed)


def _time_modules(model: torch.nn.Module, timers: Timers) -> list[Any]:
    """Forward hooks timing the target's projections, norms and lm_head by kind; returns the hook handles."""
    from mtp_train.layers.norm import RMSNorm

    handles, starts = [], {}

    def pre(kind: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            starts[id(module)] = time.perf_counter()
        return hook

    def post(kind: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            timers.seconds[kind] += time.perf_counter() - starts.pop(id(module))
        return hook

    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        if module is lm_head:
            kind = "lm_head"
        elif isinstance(module, torch.nn.Linear):
            kind = "linear"
        elif isinstance(module, RMSNorm):
            kind = "norm"
        else:
            continue
        handles += [module.register_forward_pre_hook(pre(kind)), module.register_forward_hook(post(kind))]
    return handles


def instrument(engine: LLMEngine) -> Timers:
    """Timers around every part of `engine`'s steps (see the module docstring); the engine runs as before."""
    import mtp_train.speculative.engine as spec_engine

    timers = Timers()
    _time_modules(engine.model, timers)
    attn = engine.model.attn
    timers.wrap(attn, "forward", "attention")
    timers.wrap(attn, "prepare", "attention")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "postprocess", "postprocess")
    timers.wrap(engine.runner, "forward", "forward")
    timers.wrap(engine.runner.kv, "copy_token", "kv_commit")
    proposer = getattr(engine.stepper, "proposer", None)
    if proposer is not None:
        timers.wrap(proposer, "propose", "draft")
        timers.wrap(proposer, "update", "head_update")
        # the step module's own names: layout and accept are looked up there at call time
        for name, part in (("layout", "layout"), ("accept", "accept")):
            if not hasattr(spec_engine, f"_bench_{name}"):
                setattr(spec_engine, f"_bench_{name}", getattr(spec_engine, name))
            original = getattr(spec_engine, f"_bench_{name}")
            setattr(spec_engine, name, _timed(timers, part, original))
    else:
        import mtp_train.engine.llm as llm

        if not hasattr(llm, "_bench_sample"):
            llm._bench_sample = llm.sample  # type: ignore[attr-defined]
        llm.sample = _timed(timers, "accept", llm._bench_sample)  # type: ignore[attr-defined]
    return timers


def _timed(timers: Timers, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        with timers.part(part):
            return fn(*args, **kwargs)
    return timed


def run_steps(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    """Generate each prompt alone (batch 1), timing every decode / speculative step (the prefill steps left out);
    returns ms per step for each part, `total`, `steps` and `tokens_per_step`."""
    timers = instrument(engine)
    prefill: dict[str, float] = defaultdict(float)
    total, steps, tokens = 0.0, 0, 0
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for prompt in prompts:
        seq = engine.add_request(prompt, params)
        before = dict(timers.seconds)
        engine.step()  # the prefill: its parts are taken out again below
        for k, v in timers.seconds.items():
            prefill[k] += v - before.get(k, 0.0)
        while engine.has_unfinished():
            n0 = len(seq)
            t0 = time.perf_counter()
            engine.step()
            total += time.perf_counter() - t0
            steps += 1
            tokens += len(seq) - n0
    out: dict[str, float] = {k: 1000 * (v - prefill[k]) / steps for k, v in timers.seconds.items()}
    out["total"] = 1000 * total / steps
    out["other"] = max(0.0, out.get("forward", 0.0) - sum(out.get(k, 0.0) for k in FORWARD_PARTS if k != "other"))
    out["python"] = max(0.0, out["total"] - sum(out.get(k, 0.0) for k in STEP_PARTS if k != "python"))
    out["steps"] = steps
    out["tokens_per_step"] = tokens / steps
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--head", default=None, help="a trained head folder; default: an untrained mtp head")
    ap.add_argument("--prompts", default="demo-heldout")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--tree", default="2x2x4", help="a dynamic tree STEPSxTOPKxTOKENS ('none' to skip)")
    args = ap.parse_args(argv)
    from mtp_train.cli.common import configure_from_env

    configure_from_env()
    from mtp_train.config import HeadConfig
    from mtp_train.data.chat import load_tokenizer, render
    from mtp_train.data.prompts import load_prompt_sets
    from mtp_train.heads import build_head, load_head
    from mtp_train.models import load_model
    from mtp_train.speculative.engine import SpecEngine
    from mtp_train.speculative.proposers import NgramProposer
    from mtp_train.speculative.tree_draft import TreeSpec

    model = load_model(args.model, dtype="float32")
    tokenizer = load_tokenizer(args.model)
    head = (load_head(args.head, args.model, dtype=torch.float32) if args.head else
            build_head(HeadConfig(type="mtp", init="last_layer", draft_vocab_size=8192), args.model,
                       dtype="float32"))
    convs = [c for s in load_prompt_sets([args.prompts], args.limit) for c in s.convs]
    texts = [render(tokenizer, [next(m for m in c.messages if m["role"] == "user")], add_generation_prompt=True)
             for c in convs]
    prompts = [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    configs: dict[str, Callable[[], LLMEngine]] = {"plain": lambda: LLMEngine(model, page_size=16, num_pages=512)}
    for k in [int(x) for x in args.ks.split(",")]:
        configs[f"k={k}"] = lambda k=k: SpecEngine(model, head_proposer(head), k, page_size=16, num_pages=512)
    for k in (1, 2):
        configs[f"k={k} width=2"] = lambda k=k: SpecEngine(model, head_proposer(head, draft_width=2), k,
                                                          page_size=16, num_pages=512)
    if args.tree != "none":
        spec = TreeSpec.parse(args.tree)
        configs[f"tree {args.tree}"] = lambda: SpecEngine(model, head_proposer(head, tree=spec), spec.steps,
                                                          page_size=16, num_pages=512)
    configs["lookup k=1"] = lambda: SpecEngine(model, NgramProposer(), 1, page_size=16, num_pages=512)

    with torch.inference_mode():
        LLMEngine(model, page_size=16, num_pages=64).generate(prompts[:1], SamplingParams(max_new_tokens=8))  # warm
        results = {name: run_steps(make(), prompts, args.max_new_tokens) for name, make in configs.items()}
    plain = results["plain"]["total"]
    floor = results["plain"].get("forward", plain)
    cols = [*STEP_PARTS[:3], *FORWARD_PARTS, *STEP_PARTS[4:]]
    print(f"ms per step (ratio to the plain step's {plain:.2f} ms; floor = its forward, {floor:.2f} ms = "
          f"{floor / plain:.2f})")
    print(f"{'row':>16} " + " ".join(f"{c:>11}" for c in cols) + f" {'step_cost':>9} {'tok/step':>8}")
    for name, r in results.items():
        cells = [f"{r.get(c, 0.0):5.2f}/{r.get(c, 0.0) / plain:4.2f}" for c in cols]
        print(f"{name:>16} " + " ".join(f"{c:>11}" for c in cells) + f" {r['total'] / plain:9.2f} "
              f"{r['tokens_per_step']:8.2f}")
    out = {"plain_ms": plain, "floor_ratio": floor / plain, "threads": torch.get_num_threads(),
           "rows": {name: {**{c: round(r.get(c, 0.0) / plain, 4) for c in cols},
                           "step_cost": round(r["total"] / plain, 4), "tokens_per_step": round(r["tokens_per_step"], 3),
                           "ms": round(r["total"], 3)} for name, r in results.items()},
           "median_part_share": statistics.median([r.get("forward", 0) / r["total"] for r in results.values()])}
    report(out)
    return out


if __name__ == "__main__":
    main()
