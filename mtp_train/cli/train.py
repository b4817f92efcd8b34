"""`mtp-train`: a draft head trained on target hidden states (DeepSpeed ZeRO, torchrun).

    mtp-train model=smollm2-135m head=mtp data.dir=runs/precompute out=runs/train train.max_steps=2000
    mtp-train data.source=online data.paths=[convs.jsonl] out=runs/online          # the target computes them
    mtp-train data.source=hybrid data.paths=[convs.jsonl] data.dir=runs/pc out=...  # epoch 0 writes runs/pc
    mtp-train head=eagle1 deepspeed=zero1 loss.steps=3 optim.lr=3e-4 wandb.mode=offline
    mtp-train data.source=online data.paths=[convs.jsonl] train.max_steps=1000000 train.max_seconds=240  # by the clock
    torchrun --nproc_per_node 8 -m mtp_train.cli.train model=llama3.1-8b data.dir=/data/pc out=/runs/mtp
    launch/train_1node.sh ... | launch/train_multinode.sh ... | sbatch launch/train.sbatch ...

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

from omegaconf import DictConfig

from mtp_train import dist
from mtp_train.cli.common import distributed, ensure_model, has_wandb_key, hydra_entry, run_device, save_config
from mtp_train.cli.outputs import claim_output
from mtp_train.config import ConfigError, TrainConfig, bf16_enabled, check_config, typed
from mtp_train.data.prompts import load_prompt_sets
from mtp_train.data.readers import DataError
from mtp_train.speculative.validator import SpeculativeValidator
from mtp_train.train.foreign import check_foreign_target
from mtp_train.train.logging import resolve_wandb_mode
from mtp_train.train.sources import source_class
from mtp_train.train.trainer import StepHook, train

log = logging.getLogger(__name__)
PROG = "mtp-train"


def train_main(cfg: DictConfig, on_step: StepHook | None = None) -> dict[str, Any]:
    """Run `mtp-train` with a composed config; returns the final metrics (on every rank).

    on_step(trainer, step, metrics) is called on every rank after each optimizer step (see Trainer).
    """
    check_config(cfg, "train")
    tc = typed(cfg, TrainConfig)  # a wrong value type fails here, before any process group or model is touched
    source = source_class(tc.data.source)
    source.check_config(tc)  # before the target folder is looked for: an empty model.path is named as such
    check_foreign_target(tc)  # a target our engine does not implement: only what reads no layer of it
    if tc.spec_eval.prompts:  # every input is read before the first step, not at the first evaluation
        try:
            load_prompt_sets(list(tc.spec_eval.prompts), tc.spec_eval.limit)
        except DataError as exc:
            raise ConfigError(f"spec_eval.prompts: {exc}") from None
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


main = hydra_entry(PROG, "train", train_main)


if __name__ == "__main__":
    main()
