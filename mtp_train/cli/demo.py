"""`mtp-demo`: the whole pipeline on the embedded default model, in one command.

    mtp-demo                       # runs/demo: regenerate → precompute → train → eval → export
    mtp-demo out=runs/demo2 train=[train.max_steps=200]   # replace one stage's overrides

Stages, each the project's own command run in this process with the overrides of `conf/demo.yaml`:

1. `mtp-regenerate` answers the project's demo prompts (`data=`, demo-960: data/demo_prompts*.jsonl) with the target;
2. `mtp-precompute` stores the target's hidden states over those conversations;
3. `mtp-train` trains the `mtp` head (DeepSpeed, CPU);
4. `mtp-eval` runs speculative decoding with the head on the held-out prompts against plain decoding;
5. `mtp-export` writes the head in the `native` layout.

A finished stage is recorded in `<out>/stages.json` with its overrides; a re-run skips it while its overrides
and outputs are unchanged (and each command resumes by itself if it was interrupted). `out` is new, empty or an
earlier demo's folder, held under its lock while the demo runs: one holding another command's output or unrelated
files is refused before anything is written. The summary (τ, acceptance rate, speed-up, where outputs are) is
printed and written to `<out>/summary.json`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from mtp_train.cli.common import configure_from_env, run_command
from mtp_train.cli.outputs import DEMO, claim_output
from mtp_train.config import CONF_DIR, ConfigError, DemoConfig, Interrupted, register_configs
from mtp_train.fileio import atomic_write_text

log = logging.getLogger(__name__)
PROG = "mtp-demo"
STAGES = ("regenerate", "precompute", "train", "eval", "export")


def stage_overrides(cfg: DemoConfig, out: Path) -> dict[str, list[str]]:
    """Each stage's Hydra overrides: the wiring between stages, then the config's own lists."""
    model = [f"model.path={cfg.model_path}"]
    regen = out / "regenerated.jsonl"
    return {
        "regenerate": [*model, f"data={cfg.data}", f"out={regen}", *cfg.regenerate],
        "precompute": [*model, "data=demo-regen", f"data.paths=[{regen}]", f"out={out / 'precompute'}",
                       *cfg.precompute],
        "train": [*model, "data=demo-regen", f"data.dir={out / 'precompute'}", f"out={out / 'train'}",
                  "resume=auto", *cfg.train],
        "eval": [*model, "method=head", f"out={out / 'eval'}", *cfg.eval],  # head_ckpt added after training
        "export": [f"out={out / 'export'}", *cfg.export],  # head_ckpt added after training
    }


def _compose(name: str, overrides: list[str]) -> DictConfig:
    """conf/<name>.yaml with the stage's overrides. One Hydra cannot compose (a prompt set or key that does not
    exist, a malformed override) is a ValueError naming the stage, on one line."""
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(name, overrides=overrides)
    except HydraException as exc:
        why = " ".join(str(exc).split("Config search path")[0].split())  # Hydra's search path adds nothing here
        raise ValueError(f"the {name} stage does not compose ({why}): fix its overrides in "
                         f"conf/demo.yaml or on the command line ({name}=[...], data=, model_path=)") from None


def _load_state(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def recorded_head_dir(out: Path) -> str | None:
    """The head a demo under `out` trained, as its `stages.json` records it; None before its training finished."""
    return _load_state(out / "stages.json").get("train", {}).get("head_dir") or None


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run (or resume) the pipeline under `out`'s lock; returns the summary.

    Every stage's settings are composed first, so that one that does not compose (`_compose`) is refused before
    anything is written; so is an `out` holding anything but an earlier demo's folder (another command's output,
    unrelated files, a file: `claim_output`).
    """
    register_configs()
    out = Path(cfg.out)
    overrides = stage_overrides(cfg, out)
    for stage in STAGES:  # every stage's settings checked before anything is written (the last starts minutes in)
        later = [f"head_ckpt={out / 'train'}"] if stage in ("eval", "export") else []
        _compose(stage, later + overrides[stage])
    with claim_output(out, DEMO):
        state_path = out / "stages.json"
        if not state_path.is_file():  # marks the folder as the demo's before any stage writes into it
            atomic_write_text(state_path, "{}\n")
        return _run_stages(cfg, out, state_path)


def _run_stages(cfg: DemoConfig, out: Path, state_path: Path) -> dict[str, Any]:
    """Each stage not done yet with its overrides, then the summary."""
    from mtp_train.cli.eval import eval_main
    from mtp_train.cli.export import export_main
    from mtp_train.cli.precompute import precompute_main
    from mtp_train.cli.regenerate import regenerate_main
    from mtp_train.cli.train import train_main

    state = _load_state(state_path)
    overrides = stage_overrides(cfg, out)
    mains: dict[str, tuple[str, Callable[[DictConfig], Any]]] = {
        "regenerate": ("regenerate", regenerate_main), "precompute": ("precompute", precompute_main),
        "train": ("train", train_main), "eval": ("eval", eval_main), "export": ("export", export_main),
    }
    t_run = time.perf_counter()
    rows = []
    for stage in STAGES:
        ov = list(overrides[stage])
        if stage in ("eval", "export"):
            ov.insert(0, f"head_ckpt={state['train']['head_dir']}")
        done = state.get(stage)
        outputs_exist = done is not None and all(Path(p).exists() for p in done.get("outputs", []))
        if done is not None and done.get("overrides") == ov and outputs_exist:
            rows.append((stage, "skipped", done["minutes"], done["outputs"][0]))
            continue
        name, fn = mains[stage]
        t0 = time.perf_counter()
        try:
            print(f"{PROG}: {stage} …", flush=True)  # inside: Ctrl-C right after the line names the stage too
            # The demo owns its eval and export folders and `stages.json` decides what is stale: a stage re-run
            # (a new head, other settings) replaces the report or export it made before, which the commands
            # themselves replace only when told to.
            owned = ["overwrite=true"] if stage in ("eval", "export") else []
            result = fn(_compose(name, ov + owned))
        except KeyboardInterrupt as exc:  # Ctrl-C: the stage says where it stopped, the demo which stage it was
            where = str(exc) if isinstance(exc, Interrupted) and str(exc) else \
                "before it finished; re-run the same command to go on from there"
            raise Interrupted(f"in its {stage} stage {where} (finished stages are kept)") from exc
        minutes = (time.perf_counter() - t0) / 60
        record: dict[str, Any] = {"overrides": ov, "minutes": minutes}
        if stage == "regenerate":
            record["outputs"] = [str(out / "regenerated.jsonl")]
        elif stage == "precompute":
            record["outputs"] = [str(out / "precompute" / "manifest.json")]
        elif stage == "train":
            record["head_dir"] = str(result["head_dir"])
            record["outputs"] = [str(result["head_dir"])]
            # A new head invalidates what was measured and exported from the old one.
            state.pop("eval", None)
            state.pop("export", None)
        elif stage == "eval":
            record["metrics"] = result["best"]  # the best row at T=0, as the report has it
            record["rows"] = row_summaries(result["rows"], result["best"])
            record["outputs"] = [str(out / "eval" / "report.json"), str(out / "eval" / "outputs.jsonl")]
        elif stage == "export":
            record["outputs"] = [str(result["out"])]
        state[stage] = record
        atomic_write_text(state_path, json.dumps(state, indent=2) + "\n")
        rows.append((stage, "done", minutes, record["outputs"][0]))

    summary = {
        **state["eval"]["metrics"],  # the best row: label, k and options, τ, speed-up and its 95% interval, ...
        "rows": state["eval"].get("rows", []),  # every row of the grid at T=0: τ, step_cost, speed-up, interval
        "minutes": sum(state[s]["minutes"] for s in STAGES),
        "minutes_this_run": (time.perf_counter() - t_run) / 60,
        "outputs": {s: state[s]["outputs"] for s in STAGES},
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    print_summary(rows, summary)
    print(f"summary → {out / 'summary.json'}", flush=True)
    return summary


ROW_KEYS = ("label", "method", "k", "tau", "step_cost", "speedup", "speedup_lo", "speedup_hi", "exact_match")


def row_summaries(rows: list[dict[str, Any]], best: dict[str, Any]) -> list[dict[str, Any]]:
    """The eval's rows at T=0 on the best row's dataset, with what the summary shows of each (ROW_KEYS)."""
    return [{k: r.get(k) for k in ROW_KEYS} for r in rows
            if r.get("dataset") == best.get("dataset") and not r.get("temperature")]


def print_summary(rows: list[tuple[str, str, float, str]], s: dict[str, Any]) -> None:
    print(f"\n{'stage':<11} {'status':<8} {'minutes':>7}  output")
    for stage, status, minutes, output in rows:
        print(f"{stage:<11} {status:<8} {minutes:>7.1f}  {output}")
    thr = f", threshold {s['draft_threshold']:g}" if s.get("draft_threshold") else ""
    thr += f", width {s['draft_width']}" if (s.get("draft_width") or 1) > 1 else ""
    interval = (f" [95% {s['speedup_lo']:.2f}–{s['speedup_hi']:.2f}]" if s.get("speedup_lo") is not None else "")
    if s.get("rows"):
        # τ / step_cost is the speed-up a row can give; the step's cost is what the engine adds per verified row.
        print(f"\n{'row (greedy, held-out prompts)':<40} {'τ':>5} {'step_cost':>9}  speed-up [95%]")
        for r in s["rows"]:
            ci = f" [{r['speedup_lo']:.2f}–{r['speedup_hi']:.2f}]" if r.get("speedup_lo") is not None else ""
            cost = f"{r['step_cost']:.2f}" if r.get("step_cost") is not None else "–"
            print(f"{r['label']:<40} {r['tau']:>5.2f} {cost:>9}  {r['speedup']:.2f}×{ci}")
    cost = f" · step_cost {s['step_cost']:.2f}" if s.get("step_cost") is not None else ""
    print(f"\nmtp head, k={s['k']}{thr}, greedy, held-out prompts: τ {s['tau']:.2f}{cost} · acceptance rate "
          f"{s['acceptance_rate']:.2f} · speed-up {s['speedup']:.2f}×{interval} ({s['tokens_per_s']:.1f} vs "
          f"{s['baseline_tokens_per_s']:.1f} tok/s) · identical to plain greedy: "
          f"{'yes' if s.get('exact_match') == 1.0 else s.get('exact_match')}")
    if s.get("tau_ngram") is not None:
        print(f"prompt lookup on the same prompts, k={s['k']}: τ {s['tau_ngram']:.2f} · speed-up "
              f"{s['speedup_ngram']:.2f}×")
    print(f"pipeline minutes: {s['minutes']:.1f} (this run {s['minutes_this_run']:.1f}); eval report "
          f"{s['outputs']['eval'][0]}, outputs {s['outputs']['eval'][1]}, head {s['outputs']['export'][0]}",
          flush=True)


def demo_config(args: list[str]) -> DemoConfig:
    """conf/demo.yaml with the command line's `key=value` overrides; a key it does not have, or a value of the
    wrong type, is a ConfigError naming it (OmegaConf's own error is several lines)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        base = OmegaConf.merge(OmegaConf.structured(DemoConfig), OmegaConf.load(Path(CONF_DIR) / "demo.yaml"))
        return OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(args)))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(" ".join(str(exc).split())) from None


def main(argv: list[str] | None = None) -> None:
    """`mtp-demo [key=value ...]`: overrides of conf/demo.yaml (e.g. out=runs/demo2). An error a user can fix and
    Ctrl-C end it as they end the stage commands: one line, exit 2 (`run_command`)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    configure_from_env()
    args = sys.argv[1:] if argv is None else argv
    run_command(PROG, lambda _: run_demo(demo_config(args)), None)


if __name__ == "__main__":
    main()
