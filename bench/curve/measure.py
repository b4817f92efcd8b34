"""The learning curve's measurement: τ of a head (or prompt lookup) on the held-out prompts, greedy, untimed.

`Evaluator` loads the target, tokenizer and prompts once and measures points through the engine
(`mtp_train.speculative.validator.spec_metrics`); `remeasure` measures again the points of a curve.json that predate
per-request counts. bench.curve.run drives both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import head_proposer
from bench.curve.config import VARIANTS_DIR
from bench.curve.kgrid import drafter_bound, grid_for, k_grid_record
from bench.curve.variants import LAST_FIELDS

GRID_FIELDS = ("tau", "tau_se", "acceptance_rate", "pos", "requests", "seconds")  # a k's entry of a k grid


class Evaluator:
    """The target, tokenizer and held-out prompts, loaded once; `measure(proposer_factory)` → one point."""

    def __init__(self, model: str, ev: Any) -> None:
        from mtp_train.data.chat import load_tokenizer
        from mtp_train.data.prompts import load_prompt_sets
        from mtp_train.engine.turns import stop_token_ids
        from mtp_train.models.loader import load_model

        self.model_dir, self.ev = model, ev
        self.target = load_model(model, dtype="float32", device="cpu")
        self.tokenizer = load_tokenizer(model)
        self.convs = [c for ps in load_prompt_sets(list(ev.prompts), ev.limit) for c in ps.convs]
        self.stops = stop_token_ids(self.tokenizer, self.target.args.eos_token_ids)

    def measure(self, proposer_factory: Any, k: int | None = None) -> dict[str, Any]:
        """One point: τ, its standard error over requests, acceptance, per-position acceptance, seconds, and the
        per-request counts ({request: [steps, accepted]}) that pair it with any other point on these prompts;
        at the curve's k (eval.k) unless `k` is given."""
        from mtp_train.speculative.metrics import tau_standard_error
        from mtp_train.speculative.validator import spec_metrics

        k = self.ev.k if k is None else k
        m, seconds = spec_metrics(self.target, self.tokenizer, proposer_factory, self.convs, k,
                                  self.ev.max_new_tokens, batch_size=self.ev.batch_size, stop_token_ids=self.stops)
        return {"tau": m.mean_acceptance_length, "tau_se": tau_standard_error(m.by_request),
                "acceptance_rate": m.acceptance_rate, "seconds": seconds, "pos": m.per_position[:k],
                "requests": {str(r): c for r, c in sorted(m.by_request.items())}}

    def _load(self, head_dir: Path) -> tuple[Any, dict[str, Any]]:
        """The head of an export folder, on the CPU for evaluation, and its config's `extra` (step, tokens)."""
        from mtp_train.heads import load_head, read_head_config

        head = load_head(head_dir, self.model_dir, device="cpu", dtype="float32")
        head.eval()
        return head, read_head_config(head_dir)["extra"]

    def head_point(self, head_dir: Path) -> dict[str, Any]:
        head, extra = self._load(head_dir)
        return {"step": int(extra["step"]), "tokens": int(extra["tokens_seen"]),
                **self.measure(lambda: head_proposer(head))}

    def head_k_grid(self, head_dir: Path, known: dict[str, Any] | None = None) -> dict[str, Any]:
        """The head's τ at each k of its grid (bench.curve.kgrid: eval.k_grid, or eval.block_k_grid for a drafter
        bounded by its block) and its best k; `known`: the point already measured at eval.k on this head (greedy
        decoding is deterministic: it is that k's entry, not measured again)."""
        head, extra = self._load(head_dir)
        bound = drafter_bound(head_proposer(head).max_nodes)
        by_k: dict[int, dict[str, Any]] = {}
        for k in grid_for(bound, list(self.ev.k_grid), list(self.ev.block_k_grid)):
            if known is not None and k == self.ev.k:
                by_k[k] = {f: known[f] for f in GRID_FIELDS if f in known}
                continue
            p = self.measure(lambda: head_proposer(head), k)
            by_k[k] = {f: p[f] for f in GRID_FIELDS if f in p}
            print(f"curve: {head_dir} at k = {k}: τ {p['tau']:.3f} ({p['seconds']:.0f}s)", flush=True)
        return k_grid_record(int(extra["step"]), int(extra["tokens_seen"]), bound, by_k)

    def ngram_point(self, n_max: int, n_min: int) -> dict[str, Any] | None:
        try:
            from mtp_train.speculative.proposers import NgramProposer  # type: ignore[attr-defined]
        except ImportError:
            print("curve: prompt lookup not measured (mtp_train.speculative.proposers has no NgramProposer yet); "
                  "re-run with --report-only once it has", flush=True)
            return None
        return {"n_max": n_max, "n_min": n_min, **self.measure(lambda: NgramProposer(n_max=n_max, n_min=n_min))}


def remeasure(results: dict[str, Any], out: Path, model: str, ev: Any) -> list[str]:
    """Measure again, with `ev` (the curve's evaluation settings), every point (heads' and variants') that lacks
    per-request counts and whose head is in `out` (points measured before τ had a standard error); τ is
    deterministic, so only the counts and SE are new. Returns what was measured, one `name@step` each."""
    from mtp_train.train.checkpoint import HEADS_DIR, tag_for

    evaluator: Evaluator | None = None
    done = []
    folders = [(h, out / h, rec) for h, rec in (results.get("heads") or {}).items()]
    folders += [(n, out / VARIANTS_DIR / n, row) for n, row in (results.get("variants") or {}).items()]
    for name, run_dir, rec in folders:
        for step, point in sorted((rec.get("points") or {}).items(), key=lambda kv: int(kv[0])):
            head_dir = run_dir / HEADS_DIR / tag_for(int(step))
            if point.get("requests") or not head_dir.is_dir():
                continue
            evaluator = evaluator or Evaluator(model, ev)
            fresh = evaluator.head_point(head_dir)
            if abs(fresh["tau"] - point["tau"]) > 1e-9:
                print(f"curve: {name}@{step}: τ {fresh['tau']:.4f} now, {point['tau']:.4f} in curve.json", flush=True)
            point.update({k: v for k, v in fresh.items() if k != "seconds"})
            done.append(f"{name}@{step}")
        if "variant" in rec and str(rec.get("step")) in rec.get("points", {}):
            rec.update({k: v for k, v in rec["points"][str(rec["step"])].items() if k in LAST_FIELDS})
    return done
