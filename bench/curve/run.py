"""`python -m bench.curve`: train every head of the config (and its variants), measure each point, report.

Usage: python -m bench.curve [--out runs/curve] [--max-tokens N] [--first-tokens N] [--heads mtp,eagle1]
                             [--report-only] [--doc docs/curve.md --png docs/curve.png] [key=value ...]
                             [--variants NAME,...|all [--variants-file FILE] [--full-curve]]
                             [--record docs/curve.json] [--remeasure]
--variants: recipe variants (the config's `variants:` block, bench.curve.variants) trained on the same folder,
batches and budget, measured at the last point, into `<out>/variants/<name>`; the heads' own curve then runs only
with --heads. --doc also writes <doc>.json. --record: the committed record (docs/curve.json), read first so a fresh
checkout skips what it holds, rewritten at the end. key=value: more mtp-train overrides for every head.
--report-only: the table and plot from curve.json (prompt lookup measured if missing). Last line: one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_MODEL, ROOT, compose_train, parser, report
from bench.curve import config as cc
from bench.curve.config import CONFIG, CurveConfig, CurveEval, head_aux_layers, head_available, load_config
from bench.curve.data import check_folder, data_overrides, prepare_data, same_samples
from bench.curve.kgrid import has_grid
from bench.curve.measure import Evaluator, remeasure
from bench.curve.plan import PointSaver, log_spaced, schedule
from bench.curve.record import seed, write_points_json
from bench.curve.report import fmt_tokens, summarize, write_report
from bench.curve.variants import run_variants


def train_overrides(cfg: CurveConfig, head: str, data_dir: Path, data_name: str, out: Path, model: str,
                    max_steps: int | None, extra: list[str]) -> list[str]:
    """The mtp-train overrides of one head of the curve (a variant adds its own after them). The config's own
    conversations (`data.paths`) are recorded with the run when its folder was made from them."""
    paths = [o for o in data_overrides(cfg, check=False) if o.startswith("data.paths=")]
    return [f"model.path={model}", f"head={head}", f"data={data_name}",
            *(paths if data_name == cfg.data.name else []), f"data.dir={data_dir}", f"out={out / head}",
            *cfg.train, *([f"train.max_steps={max_steps}"] if max_steps else []), *extra]


# --- the run ------------------------------------------------------------------------------------------------------


def save_results(results: dict[str, Any], out: Path) -> None:
    from mtp_train.fileio import atomic_write_text

    atomic_write_text(out / "curve.json", json.dumps(results, indent=2, sort_keys=True) + "\n")


def run_curve(cfg: CurveConfig, out: Path, model: str, extra: list[str], command: str, results: dict[str, Any],
              data: tuple[Path, str] | None = None, variants: list[cc.Variant] | None = None,
              full_curve: bool = False, run_heads: bool = True) -> dict[str, Any]:
    """Train and measure every head of cfg.heads (unless not run_heads), then every variant (resuming what
    curve.json and the run folders hold); data: (an existing precompute folder, its data name) instead of the
    one made here. With eval.k_grid (or block_k_grid), each head and variant is also measured at every k of its
    grid at the last point (bench.curve.kgrid)."""
    from mtp_train.cli.train import train_main
    from mtp_train.config.head import default_aux_layers
    from mtp_train.train.checkpoint import HEADS_DIR, tag_for

    num_layers = int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])
    folders: dict[tuple[int, ...], tuple[Path, str, str]] = {}
    walls = results.setdefault("precompute_wall_s_by_dir", {})
    union = None if cfg.aux_layers is None else tuple(int(j) for j in cfg.aux_layers)

    def data_for(reads: list[int]) -> tuple[Path, str, str]:
        """(folder, data name, description) of the precompute folder a head reading these target layers trains
        on (made once): the config's one folder (`aux_layers`) when set, else one per set of layers."""
        if union is not None:
            lacking = [j for j in reads if j not in union]
            if lacking:
                raise SystemExit(f"curve: a head reads target layers {reads}, but the config's aux_layers "
                                 f"{list(union)} lack {lacking}: add them to the curve config's `aux_layers`")
        aux = union if union is not None else tuple(reads)
        if aux not in folders:
            if data is None:
                t0 = time.perf_counter()
                # one folder of EAGLE-3's three layers keeps its historical name; other sets are named by layers
                name = None if union is not None or aux in ((), tuple(default_aux_layers(num_layers))) else (
                    "precompute-aux-" + "-".join(str(j) for j in aux))
                folders[aux] = prepare_data(cfg, out, model, list(aux), name)
                walls.setdefault(str(folders[aux][0]), time.perf_counter() - t0)
            else:
                check_folder(data[0], list(aux))
                folders[aux] = (data[0], data[1], f"the precompute folder {data[0]} (data={data[1]})")
        return folders[aux]

    available = [h for h in cfg.heads if head_available(h) is None]
    # the batch plan's probe: the first head, else the first variant's head (a curve of variants alone)
    probe_head = (available or cfg.heads or [v.head for v in variants or []] or ["mtp"])[0]
    data_dir, data_name, kind = data_for(head_aux_layers(probe_head, num_layers))
    results["precompute_wall_s"] = results.get("precompute_wall_s") or sum(walls.values())
    points = log_spaced(cfg.tokens.first, cfg.tokens.last)
    probe = compose_train(train_overrides(cfg, probe_head, data_dir, data_name, out, model, None, extra))
    plan = schedule(data_dir, points, probe)
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
    grid = bool(cfg.eval.k_grid or cfg.eval.block_k_grid)
    for head in cfg.heads if run_heads else []:
        why = head_available(head)
        if why is not None:
            print(f"curve: head {head} skipped: {why}", flush=True)
            results["skipped"][head] = why
            continue
        rec = results["heads"].setdefault(head, {"points": {}})
        run_out = out / head
        head_dir, head_data, head_kind = data_for(head_aux_layers(head, num_layers))
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
        if grid and not has_grid(rec, max_steps) and (run_out / HEADS_DIR / tag_for(max_steps)).is_dir():
            evaluator = evaluator or Evaluator(model, cfg.eval)
            rec["k_grid"] = evaluator.head_k_grid(run_out / HEADS_DIR / tag_for(max_steps),
                                                  rec["points"].get(str(max_steps)))
            print(f"curve: {head}: best k {rec['k_grid']['best_k']} (τ {rec['k_grid']['best_tau']:.3f})", flush=True)
            save_results(results, out)
    if not variants:
        return results

    plans: dict[str, list[tuple[int, int]]] = {}

    def variant_config(v: cc.Variant, steps: int) -> Any:
        """The variant's composed mtp-train config, trained to `steps`, on the folder holding what it reads (its
        layers resolved after its overrides: `head.features=aux` on mtp, a recipe's head)."""
        def composed(head_dir: Path, head_data: str) -> Any:
            shared = train_overrides(cfg, v.head, head_dir, head_data, out, model, steps, extra)
            return compose_train(cc.variant_overrides(shared, v, out / cc.VARIANTS_DIR / v.name))

        return composed(*data_for(cc.reads_layers(composed(data_dir, data_name), num_layers))[:2])

    def variant_plan(v: cc.Variant) -> list[tuple[int, int]]:
        """The curve's plan, or the variant's own where it batches otherwise (the same token points)."""
        if v.name not in plans:
            vconf = variant_config(v, max_steps)
            batching = (int(vconf.train.micro_batch_tokens), int(vconf.train.grad_accum))
            same = batching == (int(probe.train.micro_batch_tokens), int(probe.train.grad_accum))
            plans[v.name] = plan if same else schedule(data_dir, points, vconf)
        return plans[v.name]

    def variant_train(v: cc.Variant, steps: list[int]) -> dict[str, Any]:
        return train_main(variant_config(v, variant_plan(v)[-1][0]),
                          on_step=PointSaver(steps, cfg.checkpoint_every))

    def variant_measure(v: cc.Variant, step: int) -> dict[str, Any]:
        nonlocal evaluator
        evaluator = evaluator or Evaluator(model, cfg.eval)
        return evaluator.head_point(out / cc.VARIANTS_DIR / v.name / HEADS_DIR / tag_for(step))

    def variant_grid(v: cc.Variant, step: int, last: dict[str, Any]) -> dict[str, Any]:
        nonlocal evaluator
        evaluator = evaluator or Evaluator(model, cfg.eval)
        return evaluator.head_k_grid(out / cc.VARIANTS_DIR / v.name / HEADS_DIR / tag_for(step), last)

    return run_variants(results, variants, plan, recipe, full_curve, variant_train, variant_measure,
                        lambda: save_results(results, out),
                        lambda v, step: (out / cc.VARIANTS_DIR / v.name / HEADS_DIR / tag_for(step)).is_dir(),
                        plan_of=variant_plan, measure_grid=variant_grid if grid else None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser(__doc__)
    ap.prog = "python -m bench.curve"
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
        taken = seed(results, json.loads(record.read_text()))
        print(f"curve: taken from {record} as measured: {', '.join(taken) or 'nothing new'}", flush=True)
    t0 = time.perf_counter()
    if args.report_only:
        if not results:
            raise SystemExit(f"--report-only: {results_path} does not exist yet")
    else:
        command = "python -m bench.curve " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                               else sys.argv[1:]))
        data = (Path(args.data_dir), args.data_name) if args.data_dir else None
        variants = None
        if args.variants or args.variants_file:
            known = cc.load_variants_file(args.variants_file) if args.variants_file else cc.parse_variants(cfg.variants)
            variants = cc.select(known, args.variants)
            for v in variants:  # refused before the precompute folder is made
                if (why := head_available(v.head)) is not None:
                    raise SystemExit(f"curve: variant {v.name}: {why}")
        results = run_curve(cfg, out, args.model, list(args.overrides), command.strip(), results, data, variants,
                            args.full_curve or cfg.full_curve, run_heads=variants is None or bool(args.heads))
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
    known = [v.name for v in cc.parse_variants(cfg.variants)]  # rows in the config's order, others after them
    results["variant_order"] = sorted(results.get("variant_order", []),
                                      key=lambda n: known.index(n) if n in known else len(known))
    text = write_report(results, out, Path(args.doc) if args.doc else None, Path(args.png) if args.png else None)
    if record is not None:
        write_points_json(results, record)
    print(text, flush=True)
    summary = summarize(results)
    report({"out": str(out), "summary": summary, "ngram_tau": (results.get("ngram") or {}).get("tau"),
            "wall_s_this_run": results["wall_s_this_run"]})
    return results


if __name__ == "__main__":
    main()
