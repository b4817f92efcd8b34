"""Where a speculative step goes: each part of one engine step, in milliseconds and as a share of a plain decode step.

For plain decoding and each speculative row (a head's chain at k = 1..4, draft width 2, a dynamic tree, prompt
lookup), batch-1 greedy generation of the same prompts, every step broken down into:

- schedule: the scheduler's admission and page growth; postprocess: appending the tokens, stop rules;
- draft: the proposer's drafting (`propose`: a chain head's k-1 chained steps); head_update: its catch-up after
  verification, for a chain head ONE forward over the verify rows that also gives the next first draft
  (`catch_up_greedy` before acceptance for a greedy chain, `after_verify` after it; `update` for the proposers
  and the `catch_up=own` rule that run a separate pass);
- layout: the verify rows (tree layout, slots, positions); verify (or decode) forward, split by layer kind:
  layer (the decoder layers in one native call: the whole stack's, `decoder_stack`, or each layer's,
  `DecoderLayer.native`; on CPU few-row steps all of them), linear
  (every projection but the lm_head, where a layer runs op by op), attention (the backend's kernels and its
  per-step `prepare`), norm, lm_head, other (embedding, RoPE, activations, residuals: the forward's remainder);
- accept: sampling / acceptance on the logits; kv_commit: moving an accepted path's K/V into place;
- python: the rest of `engine.step()` between those parts.

Each part is printed in ms per step and as a ratio to the plain step's total, beside `step_cost` (a speculative
step in plain decode steps) and the floor: the same forward over one row (the plain step's forward). Every prompt
runs through every row in turn, so that a drift of the machine's speed falls on all rows alike. Timings come from
hooks around the parts (a few µs each, the same for every row), so read the shares, not the last decimal.

Usage: python -m bench.step --model models/smollm2-135m-instruct [--head runs/demo/train/heads/step-1000]
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
from mtp_train.config.eval import HEAD_WEIGHTS
from mtp_train.engine import LLMEngine, SamplingParams

FORWARD_PARTS = ("layer", "linear", "attention", "norm", "lm_head", "other")
STEP_PARTS = ("schedule", "draft", "layout", "forward", "accept", "kv_commit", "postprocess", "head_update", "python")


class Timers:
    """Seconds per named part, accumulated over the steps of one engine; `part(name)` times a block, re-entrantly
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


class Active:
    """The timers of the engine stepping now: the model, its attention backend and the step module are shared by
    every engine of the run, so their hooks (installed once) add to whichever engine is active."""

    timers = Timers()

    @classmethod
    def part(cls, name: str) -> Any:
        return cls.timers.part(name)


def _wrap(owner: Any, attr: str, name: str, timers: Timers | None = None) -> None:
    """Time every call of `owner.attr` as `name`, into `timers` (an engine's own object) or the active engine's."""
    fn = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        with (timers.part(name) if timers is not None else Active.part(name)):
            return fn(*args, **kwargs)

    setattr(owner, attr, timed)


def instrument_shared(model: torch.nn.Module) -> None:
    """Once per run: hooks on the target's projections, norms and lm_head by kind, its attention backend, and the
    step's own `layout`, `accept` and plain decoding's `sample`, all adding to the active engine's timers."""
    import mtp_train.engine.llm as llm
    import mtp_train.speculative.engine as spec_engine
    from mtp_train.layers.norm import RMSNorm

    starts: dict[int, float] = {}

    def pre(module: torch.nn.Module, args: Any) -> None:
        starts[id(module)] = time.perf_counter()

    def post(kind: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            Active.timers.seconds[kind] += time.perf_counter() - starts.pop(id(module))
        return hook

    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        kind = ("lm_head" if module is lm_head else "linear" if isinstance(module, torch.nn.Linear) else
                "norm" if isinstance(module, RMSNorm) else None)
        if kind is not None:
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post(kind))
    from mtp_train.layers import cpu_kernels

    _wrap(cpu_kernels, "decoder_stack", "layer")  # every layer in one native call, where all of them can
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        if hasattr(layer, "native"):  # else a Llama-family layer: the whole layer in one native call where it can
            _wrap(layer, "native", "layer")
    _wrap(model.attn, "forward", "attention")
    _wrap(model.attn, "prepare", "attention")
    _wrap(spec_engine, "layout", "layout")
    _wrap(spec_engine, "accept", "accept")
    _wrap(llm, "sample", "accept")


def instrument(engine: LLMEngine) -> Timers:
    """Timers around the engine's own parts (scheduler, runner, KV commit, proposer); the shared ones add to them
    while it is `Active`."""
    timers = Timers()
    _wrap(engine.scheduler, "schedule", "schedule", timers)
    _wrap(engine.scheduler, "postprocess", "postprocess", timers)
    _wrap(engine.runner, "forward", "forward", timers)
    _wrap(engine.runner.kv, "copy_token", "kv_commit", timers)
    proposer = getattr(engine.stepper, "proposer", None)
    if proposer is not None:
        _wrap(proposer, "propose", "draft", timers)
        _wrap(proposer, "after_verify", "head_update", timers)  # the head's part: one forward over the verify rows
        _wrap(proposer, "catch_up_greedy", "head_update", timers)  # the same, queued before acceptance (greedy)
        _wrap(proposer, "update", "head_update", timers)
    return timers


class Row:
    """One row of the table: an engine, its timers and its step counts (the prefill steps left out)."""

    def __init__(self, engine: LLMEngine, before: Callable[[], object] | None = None) -> None:
        self.engine, self.timers, self.before = engine, instrument(engine), before
        self.prefill: dict[str, float] = defaultdict(float)
        self.total, self.steps, self.tokens = 0.0, 0, 0

    def run(self, prompt: list[int], max_new_tokens: int) -> None:
        """Generate `prompt` alone (batch 1), timing each step after its prefill."""
        Active.timers = self.timers
        if self.before is not None:
            self.before()  # e.g. the head's weights this row streams (untimed)
        seq = self.engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        before = dict(self.timers.seconds)
        self.engine.step()  # the prefill: its parts are taken out again in `ms`
        for k, v in self.timers.seconds.items():
            self.prefill[k] += v - before.get(k, 0.0)
        while self.engine.has_unfinished():
            n0 = len(seq)
            t0 = time.perf_counter()
            self.engine.step()
            self.total += time.perf_counter() - t0
            self.steps += 1
            self.tokens += len(seq) - n0

    def ms(self) -> dict[str, float]:
        """ms per step for each part, `total`, `steps` and `tokens_per_step`."""
        out = {k: 1000 * (v - self.prefill[k]) / self.steps for k, v in self.timers.seconds.items()}
        out["total"] = 1000 * self.total / self.steps
        out["other"] = max(0.0, out.get("forward", 0.0) - sum(out.get(k, 0.0) for k in FORWARD_PARTS if k != "other"))
        out["python"] = max(0.0, out["total"] - sum(out.get(k, 0.0) for k in STEP_PARTS if k != "python"))
        out["steps"] = self.steps
        out["tokens_per_step"] = self.tokens / self.steps
        return out


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--head", default=None, help="a trained head folder; default: an untrained mtp head")
    ap.add_argument("--prompts", default="demo-heldout")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--tree", default="2x3x4", help="a dynamic tree STEPSxTOPKxTOKENS ('none' to skip)")
    ap.add_argument("--head-weights", default="bf16",
                    help="what the head's few-row products stream (mtp-eval's head_weights): bf16, int8, fp32, or "
                         "several (bf16,int8: every head row once per kind, interleaved prompt by prompt, the A/B "
                         "in one process)")
    args = ap.parse_args(argv)
    weights = args.head_weights.split(",")
    if not weights or any(w not in HEAD_WEIGHTS for w in weights):
        ap.error(f"--head-weights takes {', '.join(HEAD_WEIGHTS)} or several of them, got {args.head_weights!r}")
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

    plain = {"plain": lambda: LLMEngine(model, page_size=16, num_pages=512)}
    heads: dict[str, Callable[[], LLMEngine]] = {}
    for k in [int(x) for x in args.ks.split(",")]:
        heads[f"k={k}"] = lambda k=k: SpecEngine(model, head_proposer(head), k, page_size=16, num_pages=512)
    for k in (1, 2):
        heads[f"k={k} width=2"] = lambda k=k: SpecEngine(model, head_proposer(head, draft_width=2), k,
                                                        page_size=16, num_pages=512)
    if args.tree != "none":
        spec = TreeSpec.parse(args.tree)
        heads[f"tree {args.tree}"] = lambda: SpecEngine(model, head_proposer(head, tree=spec), spec.steps,
                                                        page_size=16, num_pages=512)
    lookup = {"lookup k=1": lambda: SpecEngine(model, NgramProposer(), 1, page_size=16, num_pages=512)}

    with torch.inference_mode():
        LLMEngine(model, page_size=16, num_pages=64).generate(prompts[:1], SamplingParams(max_new_tokens=8))  # warm
        instrument_shared(model)
        rows = {name: Row(make()) for name, make in plain.items()}
        for w in weights:  # a head row per weight kind (named by it when there are two)
            for name, make in heads.items():
                rows[name if len(weights) == 1 else f"{name} {w}"] = Row(
                    make(), before=lambda w=w: head.stream_weights(None if w == "fp32" else w))
        rows.update({name: Row(make()) for name, make in lookup.items()})
        # Every prompt through every row in turn: a drift of the machine's speed falls on all rows alike.
        for prompt in prompts:
            for row in rows.values():
                row.run(prompt, args.max_new_tokens)
        results = {name: row.ms() for name, row in rows.items()}
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
           "head_weights": weights,
           "rows": {name: {**{c: round(r.get(c, 0.0) / plain, 4) for c in cols},
                           "step_cost": round(r["total"] / plain, 4), "tokens_per_step": round(r["tokens_per_step"], 3),
                           "ms": round(r["total"], 3)} for name, r in results.items()},
           "median_part_share": statistics.median([r.get("forward", 0) / r["total"] for r in results.values()])}
    report(out)
    return out


if __name__ == "__main__":
    main()
