"""`make check-vllm`: our exported EAGLE, P-EAGLE, DFlash and DSpark heads served by a real vLLM beside our engine.

For each head type (eagle1, eagle3, dflash, dspark, peagle), and `dflash-speculators` (a dflash head with the demo's
8k draft vocabulary in speculators' layout, `format=speculators-dflash`: the one DFlash layout with `d2t`):

1. the head: a given folder (`--head-eagle1 DIR`, a head written by mtp-train) or a small one trained here on the
   default model with the demo recipe (the conversations of `runs/demo/regenerated.jsonl` and the hidden states of
   `runs/demo/precompute` when `make demo` left them, else regenerated and precomputed under `--out`);
2. exported (`mtp-export format=vllm-eagle` for eagle1, `format=speculators` for eagle3, `format=dflash` for
   dflash: vLLM's `method=dflash` drafts with a block of 1 + k queries, so the dflash head is trained with
   block_size k + 1 and reads the aux layers the precompute folder stores; `format=dspark` for dspark: vLLM's
   `method=dspark` queries the last token and k - 1 masks and drafts from every slot, so block_size k;
   `format=speculators-peagle` for peagle: vLLM's `method=eagle3` with `parallel_drafting` drafts its k tokens in one
   forward, so the head trains k depths);
3. measured by our `mtp-eval`: k = 3, batch 1, greedy, 96 new tokens, the first 16 held-out demo prompts;
4. served by vLLM (`checks/vllm_side.py` in vLLM's own venv): plain greedy and speculative greedy (k = 3) on the
   very prompt token ids our engine saw (rendered here with our chat template code, each later turn after our
   answer to the earlier one), one request at a time, the same max tokens and stop tokens;
5. compared: vLLM's τ and per-position acceptance beside ours, and whether vLLM's speculative tokens equal its
   plain ones (and ours). A head passes when vLLM's speculative and plain token ids are identical and vLLM's τ is
   within 5% of ours. The last line printed is one JSON object, {"eagle1": {...}, "eagle3": {...}}; the exit code
   is 1 when a checked head fails (a skipped head does not).

A head type this checkout does not implement (no conf/head/<type>.yaml, no registered head, no export format) is
reported as skipped with the reason. vLLM's own failure is recorded with its error text, and the head fails. A
method vLLM's build may refuse outright (`PROBE_FIRST`: dspark, which vLLM 0.32's CPU build refuses, docs/exports.md;
peagle, whose parallel drafting vLLM's model runner may refuse)
is first asked of vLLM with an untrained head's export on one short prompt: when vLLM's engine refuses the method
at configuration (`refusal`), the head is reported as unsupported with vLLM's error, before any training, and does
not fail the check; when vLLM runs it, the head is trained and compared like the others.

Our engine measures the head vLLM serves: for eagle1 the export as our code loads it back (`load_export`), saved
as a head. vLLM's EAGLE-1 layout has no draft vocabulary (it shares the target's lm_head), so the served head drafts
over the whole vocabulary, where the trained head (head.draft_vocab_size=8192, the demo recipe) drafts over 8192
tokens. eagle3's layout keeps its draft vocabulary (its own lm_head and d2t): the trained head is measured.

Budget, measured on 2 CPU cores shared with three other jobs, from the demo's precompute folder: eagle1 72 min
(training 200 steps 25 min, our eval 35 min, each vLLM run ~5 min, most of it start-up); an idle machine needs
well under half of that (the demo trains 200 steps in 6 min). From nothing add regeneration (~8 min) and
precompute (~6 min); eagle3 adds its training (100 steps of a 3-step test) and its eval. Stages whose outputs exist
are not redone (training resumes; our eval and the vLLM runs are keyed by their inputs), so a re-run with
unchanged inputs only prints.

    python -m checks.check_vllm --model models/smollm2-135m-instruct --vllm-python .venv-vllm/bin/python
    python -m checks.check_vllm --head-eagle1 runs/demo_eagle1/train/heads/step-200 --heads eagle1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEAD_TYPES = ("eagle1", "eagle3", "dflash", "dflash-speculators", "dspark", "peagle")  # rows: a type or a ROW_TYPE
ROW_TYPE = {"dflash-speculators": "dflash"}  # rows that check another layout of a head type
# The layout such a row exports; every other row exports its head type's layout that vLLM serves, and asks vLLM for
# the drafter that layout names (`HeadType.serving("vllm")`, `Layout.serves`: e.g. peagle's speculators-peagle as
# eagle3 with `parallel_drafting`, all k tokens in one forward).
ROW_LAYOUT = {"dflash-speculators": "speculators-dflash"}
# the demo recipe's: ~6x cheaper lm_head in training; z-lab's DFlash and the DSpark layouts draft over the whole
# vocabulary, speculators' DFlash layout carries the draft vocabulary (d2t)
DRAFT_VOCAB = {"eagle1": 8192, "eagle3": 8192, "dflash": 0, "dflash-speculators": 8192, "dspark": 0, "peagle": 8192}
BLOCK_HEADS = ("dflash", "dspark")  # trained with the block vLLM drafts (`block_recipe`)
# Methods vLLM's build may refuse outright: asked first with an untrained head (module docstring).
PROBE_FIRST = ("dspark", "peagle")
# What vLLM's engine says when its configuration refuses a method (vllm/config/vllm.py's model-runner checks).
REFUSALS = ("does not support", "does not yet support", "requires Triton")
DEMO_CONVERSATIONS = Path("runs/demo/regenerated.jsonl")
DEMO_PRECOMPUTE = Path("runs/demo/precompute")
# The demo's training recipe (conf/demo.yaml) with the head swapped; spec_eval off (mtp-eval measures afterwards).
TRAIN_RECIPE = ("loss.w_tok=1.0", "loss.ce_impl=fused", "optim.lr=1.0e-3", "optim.warmup_steps=6",
                "train.micro_batch_tokens=2048", "train.eval_every=0", "train.eval_batches=4", "train.save_every=0",
                "train.log_every=10", "train.progress=false", "spec_eval.prompts=[]", "wandb.mode=disabled")
# Per head on top: eagle1 with one step (the check is of the export, not of the recipe: a third of conf/head/
# eagle1.yaml's 3-step cost); EAGLE-3's loss (conf/head/eagle3.yaml: no feature loss, out-of-draft mask) with a
# 3-step training-time test (k = 3 drafts; EAGLE-3's 7 would cost 7x a step here) over half the steps.
# dflash / dspark: conf/head/<type>.yaml's recipe (token loss, D-PACE) with the block vLLM drafts (`block_recipe`).
# peagle: conf/head/peagle.yaml's recipe with the k depths vLLM drafts (loss.steps = k, `depth_recipe`).
HEAD_RECIPE = {"eagle1": ("loss.steps=1", "loss.position_weights=decay"),
               "eagle3": ("loss.w_feat=0", "loss.steps=3", "loss.mask_out_of_draft=true"),
               "dflash": (), "dflash-speculators": (), "dspark": (), "peagle": ()}
STEP_SHARE = {"eagle1": 1.0, "eagle3": 0.5, "dflash": 0.5, "dflash-speculators": 0.5, "dspark": 0.5,
              "peagle": 0.5}


def head_type(row: str) -> str:
    """The head type a check row trains (its own name, or ROW_TYPE's)."""
    return ROW_TYPE.get(row, row)


def export_format(row: str) -> str:
    """The layout a row exports: ROW_LAYOUT's, else the one of its head type that vLLM serves; StepError when the
    type has none (or is not registered)."""
    if row in ROW_LAYOUT:
        return ROW_LAYOUT[row]
    from mtp_train.config.head import HEAD_TYPES

    served = HEAD_TYPES.get(head_type(row)).serving("vllm") if head_type(row) in HEAD_TYPES else None
    if served is None:
        raise StepError(f"{row}: no layout of head type {head_type(row)!r} is served by vLLM")
    return served[0]


def vllm_speculative(row: str) -> dict[str, Any]:
    """vLLM's speculative settings that load the row's export as its drafter (its layout's `serves["vllm"]`, e.g.
    {"method": "eagle3", "parallel_drafting": True} for peagle)."""
    from mtp_train.export import LAYOUTS

    return dict(LAYOUTS.get(export_format(row)).serves["vllm"])


class StepError(RuntimeError):
    """A stage of the check failed; the message says which and where its log is."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct", help="the target folder")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="python of vLLM's venv")
    p.add_argument("--out", default="runs/check_vllm", help="work folder (heads, exports, evals, vLLM results)")
    p.add_argument("--heads", default=",".join(HEAD_TYPES), help="comma-separated rows (head types) to check")
    for t in HEAD_TYPES:
        p.add_argument(f"--head-{t}", default=None, help=f"a trained {t} head folder (default: train one)")
    p.add_argument("--conversations", default=None,
                   help=f"self-distilled conversations (default: {DEMO_CONVERSATIONS} if present, else regenerate)")
    p.add_argument("--precompute", default=None,
                   help=f"eagle1's precompute folder (default: {DEMO_PRECOMPUTE} if present); eagle3 uses it when "
                        "it stores aux layers")
    p.add_argument("--steps", type=int, default=200,
                   help="training steps of an eagle1 head trained here (eagle3: half of them)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--prompts", default="demo-heldout", help="prompt set (conf/data name or file)")
    p.add_argument("--limit", type=int, default=16, help="conversations of the prompt set")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest |τ_vllm − τ_ours| / τ_ours that passes")
    a = p.parse_args(argv)
    a.heads = [h.strip() for h in a.heads.split(",") if h.strip()]
    unknown = [h for h in a.heads if h not in HEAD_TYPES]
    if unknown or not a.heads:
        p.error(f"--heads: {', '.join(unknown) or 'none given'}; choose from {', '.join(HEAD_TYPES)}")
    if a.k < 1 or a.max_new_tokens < 1 or a.limit < 1 or a.steps < 1 or a.tolerance < 0:
        p.error("--k, --max-new-tokens, --limit and --steps must be ≥ 1, --tolerance ≥ 0")
    return a


# --- pure parts: comparison and verdict --------------------------------------------------------------------


def trim_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """Token ids without a final stop token: engines differ in whether the id they stopped on is in the output."""
    ids = list(ids)
    return ids[:-1] if ids and ids[-1] in set(stop_ids) else ids


def count_equal(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], stop_ids: Sequence[int]) -> int:
    """How many of the paired outputs are the same token ids (a final stop token aside)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} outputs against {len(b)}")
    return sum(trim_stop(x, stop_ids) == trim_stop(y, stop_ids) for x, y in zip(a, b))


def verdict(ours: dict[str, Any], vllm_spec: dict[str, Any], ids: dict[str, list[list[int]]],
            stop_ids: Sequence[int], tolerance: float) -> dict[str, Any]:
    """One head's entry: τ and per-position acceptance of both engines, the token-id comparisons, pass or fail.

    ours: mtp-eval's row (tau, per_position, num_drafts, num_accepted); vllm_spec: vllm_side's "spec" block;
    ids: "ours_plain", "ours_spec", "vllm_plain", "vllm_spec", each one list of token ids per turn.
    Pass: vLLM's speculative ids equal its plain ids on every turn and |τ_vllm − τ_ours| ≤ tolerance · τ_ours.
    """
    n = len(ids["vllm_plain"])
    spec_eq = count_equal(ids["vllm_spec"], ids["vllm_plain"], stop_ids)
    tau_ours, tau_vllm = float(ours["tau"]), float(vllm_spec["tau"])
    rel = abs(tau_vllm - tau_ours) / tau_ours
    entry: dict[str, Any] = {
        "tau_ours": round(tau_ours, 4), "tau_vllm": round(tau_vllm, 4), "tau_rel_diff": round(rel, 4),
        "texts_equal": spec_eq == n,
        "per_position_ours": [round(float(x), 4) for x in ours["per_position"]],
        "per_position_vllm": [round(float(x), 4) for x in vllm_spec["per_position"]],
        "drafts_ours": int(ours["num_drafts"]), "accepted_ours": int(ours["num_accepted"]),
        "drafts_vllm": int(vllm_spec["num_drafts"]), "accepted_vllm": int(vllm_spec["num_accepted"]),
        "turns": n, "turns_spec_eq_plain_vllm": spec_eq,
        "turns_vllm_plain_eq_ours": count_equal(ids["vllm_plain"], ids["ours_plain"], stop_ids),
        "turns_vllm_spec_eq_ours": count_equal(ids["vllm_spec"], ids["ours_spec"], stop_ids),
    }
    reasons = []
    if spec_eq != n:
        reasons.append(f"vLLM's speculative ids differ from its plain ids on {n - spec_eq} of {n} turns")
    if rel > tolerance:
        reasons.append(f"τ differs by {100 * rel:.1f}% (> {100 * tolerance:g}%)")
    entry["status"] = "fail" if reasons else "pass"
    if reasons:
        entry["reason"] = "; ".join(reasons)
    return entry


def exit_code(results: dict[str, dict[str, Any]]) -> int:
    """1 when a checked head failed or errored; a skipped or unsupported head counts as neither."""
    return int(any(r.get("status") in ("fail", "error") for r in results.values()))


def fmt_positions(xs: Sequence[float]) -> str:
    return " / ".join(f"{x:.3f}" for x in xs) or "-"


def report_lines(head: str, r: dict[str, Any]) -> list[str]:
    """The side-by-side text of one head's entry."""
    status = r.get("status")
    if status == "skipped":
        return [f"{head}: skipped ({r['reason']})"]
    if status == "unsupported":
        return [f"{head}: UNSUPPORTED by this vLLM build: {r['reason']}"]
    if status == "error":
        return [f"{head}: ERROR in {r.get('stage', '?')}: {r['error']}"]
    mark = "PASS" if status == "pass" else f"FAIL ({r['reason']})"
    n = r["turns"]
    return [f"{head}:                  ours      vLLM",
            f"  τ                     {r['tau_ours']:<9.4f} {r['tau_vllm']:.4f}   (Δ {100 * r['tau_rel_diff']:.2f}%)",
            f"  per position          {fmt_positions(r['per_position_ours'])}   |   "
            f"{fmt_positions(r['per_position_vllm'])}",
            f"  drafts / accepted     {r['drafts_ours']} / {r['accepted_ours']}   |   "
            f"{r['drafts_vllm']} / {r['accepted_vllm']}",
            f"  token ids: vLLM spec == vLLM plain {r['turns_spec_eq_plain_vllm']}/{n} turns; vLLM plain == ours "
            f"{r['turns_vllm_plain_eq_ours']}/{n}; vLLM spec == ours {r['turns_vllm_spec_eq_ours']}/{n}",
            f"  → {mark}"]


def digest(obj: Any) -> str:
    """A short key of a JSON-able object (what decides whether a cached result still holds)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def file_digest(path: Path) -> str | None:
    """The sha256 of a file's bytes (None when it is missing): a head's weights in the cache keys."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


# --- our side: the project's commands ----------------------------------------------------------------------


def run_command(name: str, module: str, overrides: Sequence[str], log: Path) -> None:
    """One of our commands (`python -m mtp_train.cli.<module> overrides...`) with its output in `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"check-vllm: {name}: mtp-{module} {' '.join(overrides)}  (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", f"mtp_train.cli.{module}", *overrides], cwd=ROOT,
                             stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-8:])
        raise StepError(f"{name}: mtp-{module} exited {rc} (log {log}):\n{tail}")


def aux_layers(model: Path) -> list[int]:
    """EAGLE-3's three target layers, low/mid/high, in transformers' hidden_states[j] numbering: 2, L//2, L−3."""
    n = int(json.loads((ROOT / model / "config.json").read_text())["num_hidden_layers"])
    return [2, n // 2, n - 3]


def block_recipe(k: int, aux: Sequence[int], head: str = "dflash") -> tuple[str, ...]:
    """A block head vLLM drafts for exactly as trained, over the precompute folder's aux layers: dflash, a block of
    k + 1 (vLLM's bonus token and k mask queries); dspark, a block of k (the last token and k - 1 masks, every slot
    a draft: vLLM's `sample_from_anchor`)."""
    block = k if head == "dspark" else k + 1
    return (f"head.block_size={block}", f"loss.steps={k}", f"head.aux_layers=[{','.join(map(str, aux))}]")


def depth_recipe(k: int, head: str) -> tuple[str, ...]:
    """A parallel drafter (peagle) trained on the k depths vLLM drafts in its one forward; () for other heads."""
    return (f"loss.steps={k}",) if vllm_speculative(head).get("parallel_drafting") else ()


def speculative(row: str, export: Path, k: int) -> dict[str, Any]:
    """The request's `speculative` block of a row: vLLM's method, the export, k, and parallel drafting where the row
    serves it (`vllm_side.py` passes it on)."""
    return {**vllm_speculative(row), "model": str(ROOT / export), "num_speculative_tokens": k}


def refusal(error: str) -> str | None:
    """The line of a vLLM error in which its engine refuses a method at configuration (REFUSALS), or None."""
    for line in error.splitlines():
        if any(r in line for r in REFUSALS):
            return line.strip()
    return None


def manifest_aux(folder: Path) -> list[int] | None:
    """The aux layers a precompute folder stores ([] for none), or None when it is not a finished precompute."""
    m = ROOT / folder / "manifest.json"
    return list(json.loads(m.read_text())["hidden"].get("aux_layers") or []) if m.is_file() else None


def unavailable(row: str) -> str | None:
    """Why this checkout cannot train/export/evaluate `row`'s head, or None when it can."""
    head = head_type(row)
    if not (ROOT / "conf" / "head" / f"{head}.yaml").is_file():
        return f"no conf/head/{head}.yaml in this checkout"
    from mtp_train.config import HEAD_TYPES as IMPLEMENTED
    from mtp_train.export import export_formats

    if head not in IMPLEMENTED:
        return f"head type {head!r} has no implementation (known: {', '.join(sorted(IMPLEMENTED))})"
    try:
        fmt = export_format(row)
    except StepError as e:
        return str(e)
    if fmt not in export_formats():
        return f"mtp-export has no format={fmt} (known: {', '.join(export_formats())})"
    return None


class OurSide:
    """The conversations, precompute folders and heads made here, under `out`, and our measurements."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.out, self.model = a, Path(a.out), Path(a.model)

    def conversations(self) -> Path:
        if self.a.conversations:
            return Path(self.a.conversations)
        if (ROOT / DEMO_CONVERSATIONS).is_file():
            return DEMO_CONVERSATIONS
        path = self.out / "regenerated.jsonl"
        if not (ROOT / path).is_file():  # the demo's regeneration stage (conf/demo.yaml)
            run_command("regenerate", "regenerate", [f"model.path={self.model}", "data=demo", f"out={path}",
                                                     "max_new_tokens=160", "max_batch_size=64", "progress=false"],
                        self.out / "logs" / "regenerate.log")
        return path

    def precompute(self, head: str) -> Path:
        """eagle1: the given or demo folder, else ours; eagle3: one that stores three aux layers (ours stores them);
        dflash: one that stores aux layers (it reads them all)."""
        candidates = [Path(self.a.precompute)] if self.a.precompute else [DEMO_PRECOMPUTE]
        for c in candidates:
            aux = manifest_aux(c)
            if aux is not None and (head == "eagle1" or (len(aux) == 3 if head in ("eagle3", "peagle")
                                                         else bool(aux))):
                return c
        path = self.out / "precompute"
        if manifest_aux(path) is None:  # the demo's precompute stage, plus EAGLE-3's layers (serves both heads)
            layers = ",".join(map(str, aux_layers(self.model)))
            run_command("precompute", "precompute",
                        [f"model.path={self.model}", "data=demo-regen", f"data.paths=[{self.conversations()}]",
                         f"out={path}", "max_seq_len=512", "val_fraction=0.05", f"aux_layers=[{layers}]",
                         "progress=false"], self.out / "logs" / "precompute.log")
        return path

    def head(self, head: str) -> Path:
        given = getattr(self.a, f"head_{head.replace('-', '_')}")
        if given:
            return Path(given)
        train = self.out / head / "train"
        steps = max(1, round(self.a.steps * STEP_SHARE[head]))
        head_dir = train / "heads" / f"step-{steps}"
        if not (ROOT / head_dir / "config.json").is_file():
            folder = self.precompute(head_type(head))
            kind = head_type(head)
            block = block_recipe(self.a.k, manifest_aux(folder) or [], kind) if kind in BLOCK_HEADS else ()
            run_command(f"{head} train", "train",
                        [f"model.path={self.model}", "data=demo-regen", f"data.dir={folder}",
                         f"out={train}", "resume=auto", f"head={kind}", f"head.draft_vocab_size={DRAFT_VOCAB[head]}",
                         f"train.max_steps={steps}", *TRAIN_RECIPE, *HEAD_RECIPE[head], *block,
                         *depth_recipe(self.a.k, kind)],
                        self.out / "logs" / f"{head}_train.log")
        return head_dir

    def export(self, head: str, head_dir: Path, name: str = "export") -> Path:
        out = self.out / head / name
        again = ["overwrite=true"] if name != "export" else []  # the probe's head is written anew every run
        run_command(f"{head} {name}", "export", [f"model.path={self.model}", f"head_ckpt={head_dir}",
                                                 f"format={export_format(head)}", f"out={out}", *again],
                    self.out / "logs" / f"{head}_{name}.log")
        return out

    def probe(self, head: str) -> dict[str, Any] | None:
        """Ask vLLM for `head`'s method with an untrained head (seeded; the recipe's block, EAGLE-3's aux layers)
        on one short prompt: None when vLLM runs it, else the unsupported entry with vLLM's refusal. Another vLLM
        failure raises StepError."""
        import torch

        from mtp_train.config import HeadConfig
        from mtp_train.heads import build_head, save_head

        a, head_dir = self.a, self.out / head / "probe-head"
        # a block head with the recipe's block; another (peagle) with the row's draft vocabulary
        shape = ({"block_size": a.k if head == "dspark" else a.k + 1} if head in BLOCK_HEADS
                 else {"draft_vocab_size": DRAFT_VOCAB[head]})
        torch.manual_seed(0)
        h = build_head(HeadConfig.of(type=head, aux_layers=aux_layers(self.model), **shape), ROOT / self.model,
                       dtype="float32")
        save_head(h, ROOT / head_dir, extra_config={"check_vllm": "untrained probe"})
        export = self.export(head, head_dir, "probe-export")
        req = {"model": str(ROOT / self.model), "prompts": [[1, 2, 3, 4, 5, 6, 7, 8]], "max_tokens": 2,
               "stop_token_ids": [], "max_model_len": 2048, "dtype": "float32",
               "speculative": speculative(head, export, a.k),
               "head_weights": file_digest(ROOT / export / "model.safetensors")}
        try:
            run_vllm(a, req, f"probe-{head}", self.out)
        except StepError as e:
            extra = e.args[1] if len(e.args) > 1 else {}
            why = refusal(extra.get("vllm_error", "")) or refusal("\n".join(extra.get("vllm_error_lines", [])))
            if why is None:
                raise
            return {"status": "unsupported", "reason": why, **extra}
        return None

    def served(self, head: str, head_dir: Path, export: Path) -> Path:
        """The head our engine measures (module docstring): eagle1's export loaded back, else the trained head."""
        if head != "eagle1":
            return head_dir
        from mtp_train.export import load_export
        from mtp_train.heads.checkpoint import read_head_config, save_head

        out = self.out / head / "served"
        recorded = read_head_config(ROOT / head_dir).get("target_fingerprint")
        save_head(load_export(ROOT / export, ROOT / self.model), ROOT / out, extra_config={"export": str(export)},
                  target_fingerprint=recorded)
        return out

    def evaluate(self, head: str, head_dir: Path) -> tuple[dict[str, Any], list[dict], list[dict]]:
        """mtp-eval at the check's settings: (its row, its speculative records, its plain records)."""
        a, out = self.a, self.out / head / "eval"
        overrides = [f"model.path={self.model}", "method=head", f"head_ckpt={head_dir}", f"prompts=[{a.prompts}]",
                     f"limit={a.limit}", f"k={a.k}", "draft_threshold=0.0", f"max_new_tokens={a.max_new_tokens}",
                     "batch_size=1", "temperature=0.0", "ngram.compare=false", "plots=false", "progress=false",
                     f"out={out}"]
        key = digest([overrides, file_digest(ROOT / head_dir / "model.safetensors")])
        stamp = ROOT / out / "check_vllm.key"
        if not (stamp.is_file() and stamp.read_text() == key and (ROOT / out / "report.json").is_file()):
            run_command(f"{head} eval", "eval", overrides, self.out / "logs" / f"{head}_eval.log")
            stamp.write_text(key)
        report = json.loads((ROOT / out / "report.json").read_text())
        rows = [r for r in report["rows"] if r["dataset"] != "overall" and r["method"] == "head" and r["k"] == a.k]
        if len(rows) != 1:
            raise StepError(f"{head} eval: {len(rows)} rows for method mtp k={a.k} in {out}/report.json")
        records = [json.loads(line) for line in (ROOT / out / "outputs.jsonl").read_text().splitlines() if line]
        return (rows[0], [r for r in records if r["method"] == "head"], [r for r in records if r["method"] == "none"])

    def prompts(self, plain: list[dict]) -> tuple[list[list[int]], list[int]]:
        """Every turn's prompt ids as our engine rendered them (later turns after our plain answers) and the stop
        ids; checked against the prompt lengths mtp-eval recorded."""
        from mtp_train.data.chat import load_tokenizer, render
        from mtp_train.data.prompts import load_prompt_sets
        from mtp_train.engine.turns import Dialogue, stop_token_ids
        from mtp_train.models.families import args_from_dir

        cwd = os.getcwd()
        os.chdir(ROOT)  # prompt-set paths are relative to the checkout, as for mtp-eval
        try:
            (ps,) = load_prompt_sets([self.a.prompts], self.a.limit)
        finally:
            os.chdir(cwd)
        tok = load_tokenizer(ROOT / self.model)
        stop = stop_token_ids(tok, args_from_dir(ROOT / self.model).eos_token_ids)
        by_id = {r["id"]: r for r in plain}
        prompts = []
        for conv in ps.convs:
            d = Dialogue.of(conv.messages)
            for t, turn in enumerate(by_id[conv.id]["turns"]):
                text = render(tok, d.prompt_messages(), add_generation_prompt=True)
                ids = list(tok(text, add_special_tokens=False)["input_ids"])
                if len(ids) != turn["prompt_tokens"]:
                    raise StepError(f"prompt of {conv.id} turn {t}: {len(ids)} tokens here, mtp-eval had "
                                    f"{turn['prompt_tokens']}")
                prompts.append(ids)
                d.answers.append(turn["text"])
        return prompts, stop


def turn_ids(records: list[dict], order: list[str]) -> list[list[int]]:
    """Output ids per turn, conversations in `order` (the prompt set's)."""
    by_id = {r["id"]: r for r in records}
    return [t["output_ids"] for cid in order for t in by_id[cid]["turns"]]


# --- vLLM's side: checks/vllm_side.py in its venv ----------------------------------------------------------


def vllm_error_lines(log_text: str, most: int = 6) -> list[str]:
    """The last distinct lines of a vLLM log that name an error (the engine core's cause is printed there, the
    exception the caller sees is often a generic 'engine core initialization failed')."""
    lines: list[str] = []
    for line in log_text.splitlines():
        s = line.strip()
        if ("error" in s.lower() or "not supported" in s.lower()) and s not in lines:
            lines.append(s[:400])
    return lines[-most:]


def run_vllm(a: argparse.Namespace, req: dict[str, Any], name: str, out: Path) -> dict[str, Any]:
    """vllm_side.py on `req` (cached under out/vllm by the request's digest); raises StepError with vLLM's error."""
    folder = ROOT / out / "vllm"
    folder.mkdir(parents=True, exist_ok=True)
    key = digest(req)
    result_path, req_path, log = folder / f"{name}-{key}.json", folder / f"{name}-{key}.request.json", \
        folder / f"{name}-{key}.log"
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        if "error" not in result:
            return result
    req_path.write_text(json.dumps(req) + "\n")
    print(f"check-vllm: vLLM {name} ({len(req['prompts'])} prompts; log: {log})", flush=True)
    from mtp_train import processes
    from mtp_train.capture import launch

    with tempfile.TemporaryDirectory(prefix="check-vllm-") as tmp:
        # Of this project, vLLM's venv sees only the staged vLLM-side modules (vllm_side imports vllm_generate).
        env = launch.child_env(os.environ, launch.stage_modules(Path(tmp)), 2)
        proc = processes.start([a.vllm_python, ROOT / "checks" / "vllm_side.py", "--request", req_path,
                                "--out", result_path], env, log, cwd=ROOT)
        try:
            rc = proc.wait()
        finally:
            processes.stop(proc)  # an interrupted check stops vLLM and its engine processes
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if rc != 0 or "error" in result:
        text = log.read_text(errors="replace")
        error = (result.get("error") or f"exit {rc}, no result").splitlines()
        raise StepError(f"vLLM {name}: {error[0] if error else ''}", {
            # the cause may be in the log or only in the error vllm_side recorded (a configuration refusal)
            "vllm_error": error[0] if error else "",
            "vllm_error_lines": vllm_error_lines(text + "\n" + "\n".join(error)),
            "vllm_log": str(log)})
    return result


def check_head(side: OurSide, head: str) -> dict[str, Any]:
    """Steps 1-5 of the module docstring for one head type; the head's entry."""
    a = side.a
    why = unavailable(head)
    if why:
        return {"status": "skipped", "reason": why}
    stage = "head"
    try:
        if head in PROBE_FIRST:
            stage = "vllm probe"
            refused = side.probe(head)
            if refused is not None:
                return refused
            stage = "head"
        head_dir = side.head(head)
        stage = "export"
        export = side.export(head, head_dir)
        stage = "ours"
        row, ours_spec, ours_plain = side.evaluate(head, side.served(head, head_dir, export))
        prompts, stop = side.prompts(ours_plain)
        order = [r["id"] for r in ours_plain]
        base = {"model": str(ROOT / side.model), "prompts": prompts, "max_tokens": a.max_new_tokens,
                "stop_token_ids": stop, "max_model_len": 2048, "dtype": "float32", "speculative": None}
        stage = "vllm plain"
        plain = run_vllm(a, base, "plain", side.out)
        stage = f"vllm {vllm_speculative(head)['method']}"
        spec_req = {**base, "speculative": speculative(head, export, a.k),
                    "head_weights": file_digest(ROOT / export / "model.safetensors")}
        spec = run_vllm(a, spec_req, f"spec-{head}", side.out)
        if spec.get("spec") is None:
            raise StepError(f"vLLM {head}: the engine reported no spec-decode metrics (no drafts were made)")
        ids = {"ours_plain": turn_ids(ours_plain, order), "ours_spec": turn_ids(ours_spec, order),
               "vllm_plain": [o["token_ids"] for o in plain["outputs"]],
               "vllm_spec": [o["token_ids"] for o in spec["outputs"]]}
        entry = verdict(row, spec["spec"], ids, stop, a.tolerance)
        entry.update({"head": str(head_dir), "export": str(export), "vllm_version": spec.get("vllm_version")})
        return entry
    except StepError as e:
        extra = e.args[1] if len(e.args) > 1 else {}
        return {"status": "error", "stage": stage, "error": str(e.args[0]), **extra}


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    a.vllm_python = str(Path(a.vllm_python).absolute())  # not resolved: a venv's python is a symlink
    if not Path(a.vllm_python).is_file():
        print(f"check-vllm: {a.vllm_python} not found: create vLLM's venv first (make check-vllm does)",
              file=sys.stderr)
        return 2
    side = OurSide(a)
    results: dict[str, dict[str, Any]] = {}
    for head in a.heads:
        results[head] = check_head(side, head)
        print("\n".join(report_lines(head, results[head])), flush=True)
    print(json.dumps(results), flush=True)
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
