"""`mtp-train`: a draft head trained on target hidden states (DeepSpeed ZeRO, torchrun).

    mtp-train model=smollm2-135m head=mtp data.dir=runs/precompute out=runs/train train.max_steps=2000
    mtp-train data.source=online data.paths=[convs.jsonl] out=runs/online          # the target computes them
    mtp-train data.source=hybrid data.paths=[convs.jsonl] data.dir=runs/pc out=...  # epoch 0 writes runs/pc
    mtp-train head=eagle1 deepspeed=zero1 loss.steps=3 optim.lr=3e-4 wandb.mode=offline
    mtp-train data.source=online data.paths=[convs.jsonl] train.max_steps=1000000 train.max_seconds=240  # by the clock
    torchrun --nproc_per_node 8 -m mtp_train.cli.train model=llama3.1-8b data.dir=/data/pc out=/runs/mtp
    mtp-train model=llama3.1-8b head=eagle3 plan=true plan_world=8 plan_length=32768 plan_device=cuda  # memory only
    launch/train_1node.sh ... | launch/train_multinode.sh ... | sbatch launch/train.sbatch ...

`model.path` is saved as an absolute path (in `config.yaml` and each head's `train_config.yaml`): the head's record
of its target then names it from any folder (mtp-export reads it). The head's settings are checked against the
target before anything is written: a block drafter's `head.block_size` within the target's max_position_embeddings,
and the memory its micro-batch's blocks take at least within what the device has. The run's memory plan
(`mtp_train.train.memory_plan`: the predicted peak per rank, term by term) is checked against the device's memory
before anything is written (`memory_limit_gib`, `memory_check`); `plan=true` prints it and exits.

A re-run with the same `out` resumes from its latest checkpoint (`resume=auto`). Rank 0 holds `<out>/.lock` for
the whole run (a second run into the same `out` refuses, naming the first one's pid and host), saves the resolved
config as `<out>/config.yaml` once the data, the target and the checkpoint to resume from have been checked, logs
to W&B and `<out>/metrics.jsonl`, and exports the head to `<out>/heads/step-N/`.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from mtp_train import dist
from mtp_train.cli.common import (
    distributed,
    ensure_model,
    has_wandb_key,
    hydra_entry,
    launch_env,
    run_device,
    save_config,
)
from mtp_train.cli.outputs import claim_output
from mtp_train.config import ConfigError, TrainConfig, bf16_enabled, check_config, rank_device, typed
from mtp_train.data.prompts import load_prompt_sets
from mtp_train.data.readers import DataError
from mtp_train.fileio import human_bytes
from mtp_train.models.foreign import head_target_args
from mtp_train.speculative.validator import SpeculativeValidator
from mtp_train.train.foreign import check_foreign_target
from mtp_train.train.logging import resolve_wandb_mode
from mtp_train.train.memory_plan import (
    MemoryPlan,
    check_plan,
    device_memory,
    plan_memory,
    plan_settings,
    planned_world,
    runtime_bytes,
    sample_length,
)
from mtp_train.train.sources import source_class
from mtp_train.train.trainer import StepHook, train

log = logging.getLogger(__name__)
PROG = "mtp-train"


def train_main(cfg: DictConfig, on_step: StepHook | None = None) -> dict[str, Any]:
    """Run `mtp-train` with a composed config; returns the final metrics (on every rank).

    on_step(trainer, step, metrics) is called on every rank after each optimizer step (see Trainer).
    """
    check_config(cfg, "train")
    if cfg.model.path and not Path(cfg.model.path).is_absolute():  # a head's record names its target from anywhere
        cfg.model.path = str(Path(cfg.model.path).absolute())
    tc = typed(cfg, TrainConfig)  # a wrong value type fails here, before any process group or model is touched
    source = source_class(tc.data.source)
    source.check_config(tc)  # before the target folder is looked for: an empty model.path is named as such
    check_foreign_target(tc)  # a target our engine does not implement: only what reads no layer of it
    if tc.spec_eval.prompts:  # every input is read before the first step, not at the first evaluation
        try:
            load_prompt_sets(list(tc.spec_eval.prompts), tc.spec_eval.limit)
        except DataError as exc:
            raise ConfigError(f"spec_eval.prompts: {exc}") from None
    check_head_fits(tc)
    if tc.plan:  # the plan alone: nothing is trained, written or fetched
        return show_plan(tc)
    check_memory(tc)
    with distributed(tc.model) as (info, stack):
        # DeepSpeed reads LOCAL_RANK from the environment, which only launchers set (see train/deepspeed_setup.py).
        os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
        group = dist.cpu_group(timedelta(hours=2))  # rank 0 may fetch the default model meanwhile
        out = Path(cfg.out)
        if info.is_main:
            # Refuses a foreign `out` (or one holding a link out of it), then locks it, before any write.
            stack.enter_context(claim_output(out, PROG, overwrite=tc.overwrite))
            source.lock(tc, out, stack, PROG)  # hybrid writes data.dir too: one run at a time there as well
            ensure_model(cfg.model)
        dist.barrier(group)
        device = run_device(tc.model, info)
        validator = None
        if tc.spec_eval.prompts and info.is_main:
            validator = SpeculativeValidator(tc.spec_eval, tc.model, device,
                                             "bfloat16" if bf16_enabled(device) else "float32")
        wandb_mode = resolve_wandb_mode(tc.wandb.mode, has_wandb_key()) if info.is_main else "disabled"
        result = train(tc, info, device, wandb_mode=wandb_mode, validator=validator, on_step=on_step,
                       on_start=lambda: save_config(cfg, out / "config.yaml"))
        if info.is_main:
            top1 = result.get("eval/top1")
            timed = result.get("stopped_by") == "max_seconds"
            print(f"{PROG}: step {result['step']}"
                  + (f" (train.max_seconds reached after {result['train_seconds']:.0f} s)" if timed else "")
                  + f", train loss {result.get('train/loss', float('nan')):.4f}"
                  + (f", eval top-1 {top1:.3f}" if top1 is not None else "")
                  + f"; head → {result['head_dir']}", flush=True)
        return result


def check_head_fits(tc: TrainConfig) -> None:
    """Refuse, naming the key, the bound and why, head settings the target or the memory cannot hold, as the head's
    type says (`HeadSettings.fit_problem`: a block drafter's head.block_size past the target's
    max_position_embeddings, or blocks whose memory alone is over what the device has free). A target folder still
    to be fetched is checked by the settings' own bounds only (e.g. a block drafter's MAX_BLOCK_SIZE)."""
    config = Path(tc.model.path) / "config.json"
    if not config.is_file():
        return
    args = head_target_args(tc.model.path)
    launch = launch_env()
    device = rank_device(tc.model.device, launch.world, launch.local_rank)
    problem = tc.head.settings.fit_problem(args.max_position_embeddings, args.hidden_size,
                                           lambda: free_memory(device), human_bytes, str(config), str(device))
    if problem:
        raise ConfigError(problem)


def run_plan(tc: TrainConfig) -> tuple[MemoryPlan, str] | None:
    """The memory plan of this run (plan_* settings over the launch's) and where its sample length came from, or
    None when the target's config.json is not there yet (a folder still to be fetched)."""
    if not (Path(tc.model.path) / "config.json").is_file():
        return None
    launch = launch_env()
    device = tc.plan_device or rank_device(tc.model.device, launch.world, launch.local_rank).type
    length, source = sample_length(tc)
    args = head_target_args(tc.model.path)
    settings = plan_settings(tc, args, device, planned_world(tc, launch.world), length, runtime_bytes(device))
    return plan_memory(settings, args), source


def show_plan(tc: TrainConfig) -> dict[str, Any]:
    """`plan=true`: print the plan (rank 0) and return it, without training or writing anything."""
    planned = run_plan(tc)
    if planned is None:
        raise ConfigError(f"plan=true needs the target's config.json: {Path(tc.model.path) / 'config.json'} is "
                          "missing; point model.path at a folder holding it (the weights are not needed)")
    plan, source = planned
    if launch_env().rank == 0:
        print("\n".join(plan.lines()), flush=True)
        print(f"(sample length from {source}; nothing was trained or written)", flush=True)
    return {"plan": {t.name: t.bytes for t in plan.terms}, "plan_total": plan.total}


def check_memory(tc: TrainConfig) -> None:
    """Refuse, before anything is written, a run whose memory plan is over what a rank may use (memory_limit_gib,
    else the device's: a GPU's total memory, or the CPU memory available to this process shared by the launch's
    ranks); memory_check=false only logs it."""
    try:
        planned = run_plan(tc)
    except (ConfigError, ValueError) as exc:  # settings the run's own checks refuse, by name, further on
        log.debug("no memory plan: %s", exc)
        return
    if planned is None:
        return
    plan = planned[0]
    launch = launch_env()
    if tc.memory_limit_gib > 0:
        limit, what = int(tc.memory_limit_gib * 2**30), f"memory_limit_gib={tc.memory_limit_gib:g}"
    else:
        found, what = device_memory(plan.settings.device)
        if found is None:
            return
        # CPU ranks of one launch share the host's memory
        ranks = launch.world if plan.settings.device == "cpu" else 1
        limit = found // ranks
        what += f" / {ranks} ranks" if ranks > 1 else ""
    log.info("memory plan: %s per rank of %s (%s)", human_bytes(plan.total), human_bytes(limit), what)
    if tc.memory_check:
        check_plan(plan, limit, what)


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device`: the GPU's free memory, or the host's available memory for the CPU (None when the
    system does not say)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


main = hydra_entry(PROG, "train", train_main)


if __name__ == "__main__":
    main()
