"""The learning curve: τ of each head against its training tokens, beside prompt lookup, at equal budgets.

Config: conf/experiment/curve.yaml. Every head listed there is trained once, with the same recipe on the same
precompute folder (the same batches in the same order), to the last token point, into `<out>/<head>`; the step hook
exports the head where the training tokens (packed rows) reach each log-spaced point and keeps a resumable
checkpoint every `checkpoint_every` steps, so a re-run resumes and skips measured points. Each point is measured by
bench/curve_measure.py (greedy speculative decoding through the engine on held-out prompts: τ at k with its standard
error, per-position acceptance; untimed), and prompt lookup once on the same prompts, the floor a head must clear.
Data: the shared self-distilled set when ../shared/data has it (data=shared-regen), else the demo's conversations.
Outputs in `--out` (default runs/curve): curve.json (every point), curve.md and curve.png (bench/curve_report.py).

Usage: python bench/curve.py [--out runs/curve] [--max-tokens N] [--first-tokens N] [--heads mtp,eagle1]
                             [--report-only] [--doc docs/curve.md --png docs/curve.png] [key=value ...]
                             [--variants NAME,...|all [--variants-file FILE] [--full-curve]]
                             [--record docs/curve.json] [--remeasure]
--variants: recipe variants (the config's `variants:` block, bench/curve_variants.py) trained on the same folder,
batches and budget, measured at the last point, into `<out>/variants/<name>`; the heads' own curve then runs only
with --heads. --doc also writes <doc>.json. --record: the committed record (docs/curve.json), read first so a fresh
checkout skips what it holds, rewritten at the end. key=value: more mtp-train overrides for every head.
--report-only: the table and plot from curve.json (prompt lookup measured if missing). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import curve_variants as cv  # noqa: E402
from bench_train import DEFAULT_MODEL, compose_train  # noqa: E402
from common import compose, report  # noqa: E402
from curve_measure import Evaluator, remeasure  # noqa: E402
from curve_report import fmt_tokens, summarize, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "conf" / "experiment" / "curve.yaml"
SHARED_REGEN = ROOT.parent / "shared" / "data" / "train" / "regen_smollm2_greedy.jsonl"


# --- config -------------------------------------------------------------------------------------------------------


@dataclass
class TokenPoints:
    first: int = 16384  # the first evaluation point, in training tokens
    last: int = 1048576  # the budget (and the last point)


@dataclass
class CurveEval:
    prompts: list[str] = field(default_factory=lambda: ["demo-heldout"])
    limit: int = 32
    k: int = 3
    max_new_tokens: int = 96
    batch_size: int = 8


@dataclass
class CurveConfig:
    """conf/experiment/curve.yaml, typed (a misspelt key is refused by name)."""

    heads: list[str] = field(default_factory=lambda: ["mtp", "eagle1"])
    tokens: TokenPoints = field(default_factory=TokenPoints)
    checkpoint_every: int = 64
    precompute: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    eval: CurveEval = field(default_factory=CurveEval)
    ngram: dict[str, int] = field(default_factory=lambda: {"n_max": 3, "n_min": 1})
    variants: dict[str, cv.VariantSpec] = field(default_factory=dict)  # bench/curve_variants.py; run by --variants


def load_config(path: str | Path = CONFIG) -> CurveConfig:
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(CurveConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def log_spaced(first: int, last: int) -> list[int]:
    """first, 2·first, 4·first, ... below last, then last itself ([last] when last ≤ first)."""
    if first < 1 or last < 1:
        raise ValueError(f"token points must be positive, got first={first}, last={last}")
    points = []
    t = first
    while t < last:
        points.append(t)
        t *= 2
    return points + [last]


def head_available(name: str) -> str | None:
    """None when conf/head/<name>.yaml exists and its type is implemented, else why the head is skipped."""

    from mtp_train.heads import HEAD_TYPES

    path = ROOT / "conf" / "head" / f"{name}.yaml"
    if not path.is_file():
        return f"no conf/head/{name}.yaml"
    type_ = str(head_conf(name).get("type", name))
    if type_ not in HEAD_TYPES:
        return f"head type {type_!r} has no implementation yet (known: {', '.join(sorted(HEAD_TYPES))})"
    return None


def head_conf(name: str) -> Any:
    """The `head` block of conf/head/<name>.yaml (a `# @package _global_` file nests it under `head:`)."""
    from omegaconf import OmegaConf

    conf = OmegaConf.load(ROOT / "conf" / "head" / f"{name}.yaml")
    return conf.head if "head" in conf else conf


def head_aux_layers(name: str, num_layers: int) -> list[int]:
    """The target layers (hidden_states numbering) a head reads as features; [] for heads on the final state.

    A head with `features: aux` (eagle3) needs a precompute folder that holds those layers; every other head
    trains on a folder without them (the same samples, so the same batches).
    """
    from mtp_train.config.head import default_aux_layers

    head = head_conf(name)
    if str(head.get("features", "final")) != "aux":
        return []
    return [int(j) for j in (head.get("aux_layers") or [])] or default_aux_layers(num_layers)


# --- the batch plan: which step reaches which token count ---------------------------------------------------------


def steps_for_tokens(lengths: list[int], micro_batch_tokens: int, grad_accum: int, seed: int,
                     points: list[int]) -> list[tuple[int, int]]:
    """(step, tokens seen after it) of the first optimizer step whose cumulative packed rows reach each point.

    Replays the trainer's batch plan (LengthBucketedBatchSampler over epochs, one rank) on the sample lengths,
    so the steps are exact for a run with these settings.
    """
    from mtp_train.data.sampler import LengthBucketedBatchSampler

    sampler = LengthBucketedBatchSampler(lengths, micro_batch_tokens, shuffle=True, seed=seed)
    out: list[tuple[int, int]] = []
    todo = sorted(points)
    step = tokens = epoch = micro = 0
    while todo:
        sampler.set_epoch(epoch)
        for batch in sampler:
            tokens += sum(lengths[i] for i in batch)
            micro += 1
            if micro % grad_accum:
                continue
            step += 1
            while todo and tokens >= todo[0]:
                out.append((step, tokens))
                todo.pop(0)
            if not todo:
                break
        epoch += 1
    return out


class PointSaver:
    """The step hook: export the head (with a full checkpoint) at the points' steps and every `every` steps,
    then delete every full checkpoint but the newest, and the exports that are not points."""

    def __init__(self, point_steps: list[int], every: int) -> None:
        self.point_steps, self.every = set(point_steps), every

    def __call__(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        from mtp_train.train.checkpoint import CKPT_DIR, HEADS_DIR, latest_tag, tag_for

        due = step in self.point_steps or (self.every and step % self.every == 0)
        ckpt = trainer.out / CKPT_DIR
        if not due or latest_tag(ckpt) == tag_for(step):  # saved already (train.save_every)
            return
        trainer.save()
        if not trainer.info.is_main:
            return
        keep = {tag_for(s) for s in self.point_steps}
        for d in ckpt.glob("step-*"):
            if d.name != tag_for(step):
                shutil.rmtree(d, ignore_errors=True)
        for d in (trainer.out / HEADS_DIR).glob("step-*"):
            if d.name not in keep and d.name != tag_for(step):
                shutil.rmtree(d, ignore_errors=True)


# --- data, training, evaluation -----------------------------------------------------------------------------------


def prepare_data(cfg: CurveConfig, out: Path, model: str, aux_layers: list[int]) -> tuple[Path, str, str]:
    """The precompute folder (made or resumed here), holding `aux_layers` besides the final hidden state when
    given (in `precompute-aux`); returns (folder, data name, description)."""
    from mtp_train.cli.precompute import precompute_main

    name = "precompute-aux" if aux_layers else "precompute"
    aux = [f"aux_layers=[{','.join(str(j) for j in aux_layers)}]"] if aux_layers else []
    if SHARED_REGEN.is_file():
        pc = out / name
        precompute_main(compose("precompute", [f"model.path={model}", "data=shared-regen", f"out={pc}",
                                               *cfg.precompute, *aux]))
        return pc, "shared-regen", f"shared self-distilled set ({SHARED_REGEN.name}), {' '.join(cfg.precompute)}"
    from omegaconf import OmegaConf

    from mtp_train.cli.demo import stage_overrides
    from mtp_train.cli.regenerate import regenerate_main
    from mtp_train.config import DemoConfig

    demo = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DemoConfig),
                                               OmegaConf.load(ROOT / "conf" / "demo.yaml")))
    demo.model_path = model
    stages = stage_overrides(demo, out / "demo")
    regenerate_main(compose("regenerate", stages["regenerate"]))
    pc = out / "demo" / name
    precompute_main(compose("precompute", [o for o in stages["precompute"] if not o.startswith("out=")]
                            + [f"out={pc}", *aux]))
    kind = "the demo's own conversations (data/demo_prompts.jsonl answered by the target)"
    return pc, "demo-regen", kind


def check_folder(data_dir: Path, aux_layers: list[int]) -> None:
    """A given --data-dir must hold the layers a head reads."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    have = [int(j) for j in manifest["hidden"].get("aux_layers", [])]
    if aux_layers and have != list(aux_layers):
        raise SystemExit(f"curve: {data_dir}/manifest.json holds aux_layers {have}, but a head of the curve reads "
                         f"{aux_layers}: precompute a folder with `mtp-precompute aux_layers=[...]` for it, or drop "
                         f"--data-dir to let the curve make both folders")


def train_overrides(cfg: CurveConfig, head: str, data_dir: Path, data_name: str, out: Path, model: str,
                    max_steps: int | None, extra: list[str]) -> list[str]:
    return [f"model.path={model}", f"head={head}", f"data={data_name}", f"data.dir={data_dir}", f"out={out / head}",
            *cfg.train, *([f"train.max_steps={max_steps}"] if max_steps else []), *extra]


def schedule(cfg: CurveConfig, data_dir: Path, points: list[int], train_cfg: Any) -> list[tuple[int, int]]:
    from mtp_train.precompute import PrecomputedDataset

    lengths = PrecomputedDataset(data_dir, split="train", verify="never").lengths
    return steps_for_tokens(list(lengths), int(train_cfg.train.micro_batch_tokens), int(train_cfg.train.grad_accum),
                            int(train_cfg.train.seed), points)


def same_samples(a: Path, b: Path) -> None:
    """Two precompute folders of one curve must hold the same training samples (so the same batch plan)."""
    from mtp_train.precompute import PrecomputedDataset

    la = list(PrecomputedDataset(a, split="train", verify="never").lengths)
    lb = list(PrecomputedDataset(b, split="train", verify="never").lengths)
    if la != lb:
        raise SystemExit(f"curve: {a} and {b} hold different training samples ({len(la)} vs {len(lb)}); "
                         f"precompute both with the same data and precompute overrides")


# --- the run ------------------------------------------------------------------------------------------------------


def save_results(results: dict[str, Any], out: Path) -> None:
    from mtp_train.fileio import atomic_write_text

    atomic_write_text(out / "curve.json", json.dumps(results, indent=2, sort_keys=True) + "\n")


def run_curve(cfg: CurveConfig, out: Path, model: str, extra: list[str], command: str, results: dict[str, Any],
              data: tuple[Path, str] | None = None, variants: list[cv.Variant] | None = None,
              full_curve: bool = False, run_heads: bool = True) -> dict[str, Any]:
    """Train and measure every head of cfg.heads (unless not run_heads), then every variant (resuming what
    curve.json and the run folders hold); data: (an existing precompute folder, its data name) instead of the
    one made here."""
    from mtp_train.cli.train import train_main
    from mtp_train.train.checkpoint import HEADS_DIR, tag_for

    num_layers = int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])
    folders: dict[tuple[int, ...], tuple[Path, str, str]] = {}
    walls = results.setdefault("precompute_wall_s_by_dir", {})

    def data_for(head: str) -> tuple[Path, str, str]:
        """(folder, data name, description) of the precompute folder this head trains on (made once)."""
        aux = tuple(head_aux_layers(head, num_layers))
        if aux not in folders:
            if data is None:
                t0 = time.perf_counter()
                folders[aux] = prepare_data(cfg, out, model, list(aux))
                walls.setdefault(str(folders[aux][0]), time.perf_counter() - t0)
            else:
                check_folder(data[0], list(aux))
                folders[aux] = (data[0], data[1], f"the precompute folder {data[0]} (data={data[1]})")
        return folders[aux]

    available = [h for h in cfg.heads if head_available(h) is None]
    data_dir, data_name, kind = data_for(available[0] if available else cfg.heads[0])
    results["precompute_wall_s"] = results.get("precompute_wall_s") or sum(walls.values())
    points = log_spaced(cfg.tokens.first, cfg.tokens.last)
    probe = compose_train(train_overrides(cfg, cfg.heads[0], data_dir, data_name, out, model, None, extra))
    plan = schedule(cfg, data_dir, points, probe)
    max_steps = plan[-1][0]
    recipe = [*cfg.train, *extra]
    if results.get("recipe") not in (None, recipe) or results.get("max_steps") not in (None, max_steps):
        print("curve: the recipe or budget changed since curve.json was written; its points are dropped "
              "(delete the head folders under the out folder to retrain)", flush=True)
        results["heads"] = {}
    results.update({"command": command, "data": kind, "data_dir": str(data_dir), "recipe": recipe,
                    "budget_tokens": cfg.tokens.last, "points": points, "plan": plan, "max_steps": max_steps,
                    "eval": dataclasses.asdict(cfg.eval), "skipped": {}, "head_order": list(cfg.heads),
                    "data_dirs": results.get("data_dirs", {})})
    results.setdefault("heads", {})
    print(f"curve: {len(points)} points {', '.join(fmt_tokens(p) for p in points)} tokens → steps "
          f"{[s for s, _ in plan]} (max_steps {max_steps}); data: {kind}", flush=True)
    evaluator: Evaluator | None = None
    for head in cfg.heads if run_heads else []:
        why = head_available(head)
        if why is not None:
            print(f"curve: head {head} skipped: {why}", flush=True)
            results["skipped"][head] = why
            continue
        rec = results["heads"].setdefault(head, {"points": {}})
        run_out = out / head
        head_dir, head_data, head_kind = data_for(head)
        results["data_dirs"][head] = str(head_dir)
        if head_dir != data_dir:
            same_samples(data_dir, head_dir)
            results["data_dirs_note"] = (f"heads that read target layers besides the final state train on "
                                         f"{head_dir}: the same samples with those layers stored")
        if not (run_out / HEADS_DIR / tag_for(max_steps)).is_dir():
            t0 = time.perf_counter()
            ov = train_overrides(cfg, head, head_dir, head_data, out, model, max_steps, extra)
            final = train_main(compose_train(ov), on_step=PointSaver([s for s, _ in plan], cfg.checkpoint_every))
            rec["train_wall_s"] = rec.get("train_wall_s", 0.0) + time.perf_counter() - t0
            rec["final"] = {k: v for k, v in final.items() if k.startswith(("eval/", "train/"))}
            save_results(results, out)
        for step, _ in plan:
            if str(step) in rec["points"]:
                continue
            evaluator = evaluator or Evaluator(model, cfg.eval)
            p = evaluator.head_point(run_out / HEADS_DIR / tag_for(step))
            rec["points"][str(step)] = p
            print(f"curve: {head} step {step} ({fmt_tokens(p['tokens'])} tokens): τ {p['tau']:.3f}, pos "
                  f"{' / '.join(f'{a:.3f}' for a in p['pos'])} ({p['seconds']:.0f}s)", flush=True)
            save_results(results, out)
    if not variants:
        return results

    plans: dict[str, list[tuple[int, int]]] = {}

    def variant_config(v: cv.Variant, steps: int) -> Any:
        """The variant's composed mtp-train config, trained to `steps`."""
        head_dir, head_data, _ = data_for(v.head)
        shared = train_overrides(cfg, v.head, head_dir, head_data, out, model, steps, extra)
        return compose_train(cv.variant_overrides(shared, v, out / cv.VARIANTS_DIR / v.name))

    def variant_plan(v: cv.Variant) -> list[tuple[int, int]]:
        """The curve's plan, or the variant's own where it batches otherwise (the same token points)."""
        if v.name not in plans:
            vconf = variant_config(v, max_steps)
            batching = (int(vconf.train.micro_batch_tokens), int(vconf.train.grad_accum))
            same = batching == (int(probe.train.micro_batch_tokens), int(probe.train.grad_accum))
            plans[v.name] = plan if same else schedule(cfg, data_dir, points, vconf)
        return plans[v.name]

    def variant_train(v: cv.Variant, steps: list[int]) -> dict[str, Any]:
        return train_main(variant_config(v, variant_plan(v)[-1][0]),
                          on_step=PointSaver(steps, cfg.checkpoint_every))

    def variant_measure(v: cv.Variant, step: int) -> dict[str, Any]:
        nonlocal evaluator
        evaluator = evaluator or Evaluator(model, cfg.eval)
        return evaluator.head_point(out / cv.VARIANTS_DIR / v.name / HEADS_DIR / tag_for(step))

    return cv.run_variants(results, variants, plan, recipe, full_curve, variant_train, variant_measure,
                           lambda: save_results(results, out),
                           lambda v, step: (out / cv.VARIANTS_DIR / v.name / HEADS_DIR / tag_for(step)).is_dir(),
                           plan_of=variant_plan)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--model", default=str(DEFAULT_MODEL.relative_to(ROOT)))
    ap.add_argument("--out", default="runs/curve")
    ap.add_argument("--data-dir", default=None, help="an existing precompute folder of the target (else made here)")
    ap.add_argument("--data-name", default="shared-regen", help="the conf/data name --data-dir was made from")
    ap.add_argument("--max-tokens", type=int, default=None, help="the budget (tokens.last); default: the config's")
    ap.add_argument("--first-tokens", type=int, default=None, help="the first point (tokens.first)")
    ap.add_argument("--heads", default=None, help="comma-separated conf/head names (default: the config's)")
    ap.add_argument("--eval-limit", type=int, default=None, help="held-out conversations (eval.limit)")
    ap.add_argument("--report-only", action="store_true",
                    help="only the table and plot from curve.json (and prompt lookup if missing)")
    ap.add_argument("--no-ngram", action="store_true", help="do not measure prompt lookup")
    ap.add_argument("--doc", default=None, help="also write the Markdown here (e.g. docs/curve.md)")
    ap.add_argument("--png", default=None, help="also write the plot here (e.g. docs/curve.png)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variant names of the config's `variants:` block (or `all`): train and "
                         "measure them at the budget (the heads' curve is then run only with --heads)")
    ap.add_argument("--variants-file", default=None, help="a YAML file whose `variants:` block replaces the config's")
    ap.add_argument("--full-curve", action="store_true", help="measure the variants at every point, not the last")
    ap.add_argument("--remeasure", action="store_true",
                    help="measure again the points without per-request counts whose heads are in --out (their τ's "
                         "standard error and pairing), then report")
    ap.add_argument("--record", default=None,
                    help="a committed record (e.g. docs/curve.json): what it holds and curve.json lacks is taken "
                         "as measured (skipped), and it is rewritten with this run's rows at the end")
    ap.add_argument("overrides", nargs="*", help="more mtp-train overrides for every head, key=value")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    cfg.tokens.last, cfg.tokens.first = args.max_tokens or cfg.tokens.last, args.first_tokens or cfg.tokens.first
    cfg.eval.limit = args.eval_limit or cfg.eval.limit
    if args.heads:
        cfg.heads = [h for h in args.heads.split(",") if h]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "curve.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.is_file() else {}
    record = Path(args.record) if args.record else None
    if record is not None and record.is_file():
        taken = cv.seed(results, json.loads(record.read_text()))
        print(f"curve: taken from {record} as measured: {', '.join(taken) or 'nothing new'}", flush=True)
    t0 = time.perf_counter()
    if args.report_only:
        if not results:
            raise SystemExit(f"--report-only: {results_path} does not exist yet")
    else:
        command = "python bench/curve.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                               else sys.argv[1:]))
        data = (Path(args.data_dir), args.data_name) if args.data_dir else None
        variants = None
        if args.variants or args.variants_file:
            known = cv.load_variants_file(args.variants_file) if args.variants_file else cv.parse_variants(cfg.variants)
            variants = cv.select(known, args.variants)
            for v in variants:  # refused before the precompute folder is made
                if (why := head_available(v.head)) is not None:
                    raise SystemExit(f"curve: variant {v.name}: {why}")
        results = run_curve(cfg, out, args.model, list(args.overrides), command.strip(), results, data, variants,
                            args.full_curve, run_heads=variants is None or bool(args.heads))
    if args.remeasure:
        again = remeasure(results, out, args.model, CurveEval(**results["eval"]))
        print(f"curve: measured again (per-request counts): {', '.join(again) or 'none'}", flush=True)
        save_results(results, out)
    if not args.no_ngram and not results.get("ngram"):
        ev = CurveEval(**results["eval"])
        results["ngram"] = Evaluator(args.model, ev).ngram_point(int(cfg.ngram["n_max"]), int(cfg.ngram["n_min"]))
        save_results(results, out)
    results["wall_s_this_run"] = time.perf_counter() - t0
    save_results(results, out)
    known = [v.name for v in cv.parse_variants(cfg.variants)]  # rows in the config's order, others after them
    results["variant_order"] = sorted(results.get("variant_order", []),
                                      key=lambda n: known.index(n) if n in known else len(known))
    text = write_report(results, out, Path(args.doc) if args.doc else None, Path(args.png) if args.png else None)
    if record is not None:
        cv.write_points_json(results, record)
    print(text, flush=True)
    summary = summarize(results)
    report({"out": str(out), "summary": summary, "ngram_tau": (results.get("ngram") or {}).get("tau"),
            "wall_s_this_run": results["wall_s_this_run"]})
    return results


if __name__ == "__main__":
    main()
