"""`mtp-precompute`: conversations → target hidden states as sharded safetensors with a manifest.

    mtp-precompute model=smollm2-135m data.paths=[convs.jsonl] out=runs/precompute max_seq_len=2048 limit=1000
    mtp-precompute data=shared-regen out=runs/pc aux_layers=[2,15,27]
    mtp-precompute backend=vllm vllm_python=.venv-vllm/bin/python out=runs/pc aux_layers=[2,15,27]
    mtp-precompute backend=vllm vllm.serve_command=true vllm.spool_dir=/shared/capture aux_layers=[2,15,27]
    mtp-precompute backend=vllm vllm.endpoints=[http://gpu1:8000,http://gpu2:8000] vllm.spool_dir=/shared/capture ...
    torchrun --nproc_per_node 8 -m mtp_train.cli.precompute model=llama3.1-8b data.paths=[...] out=/data/pc
    torchrun --nproc_per_node 8 -m mtp_train.cli.precompute model=llama3.1-70b model.tp=8 data.paths=[...] out=...

A re-run with the same settings resumes: finished shards are verified and skipped; one into its finished folder
says so and changes nothing. Each rank writes its own shards; rank 0 writes `manifest.json` last. Rank 0 holds
`<out>/.lock` for the whole run (a second run into the same `out` refuses, naming the first one's pid and host).
The resolved config is saved as `<out>/config.yaml` once the data has been read and tokenized (and, with
`vllm.endpoints`, the servers probed), so a run refused over its inputs leaves the folder as it was.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mtp_train import dist
from mtp_train.cli.common import (
    distributed,
    ensure_model,
    hydra_entry,
    launch_env,
    load_target,
    run_device,
    save_config,
    to_dict,
)
from mtp_train.cli.outputs import claim_output
from mtp_train.config import PrecomputeConfig, check_config, typed
from mtp_train.data.samples import dropped_summary
from mtp_train.precompute.manifest import Manifest
from mtp_train.precompute.pipeline import run_precompute
from mtp_train.precompute.vllm_backend import PRECOMPUTE_BACKENDS, check_vllm_python, precompute_vllm, serve_command

log = logging.getLogger(__name__)
PROG = "mtp-precompute"


def precompute_main(cfg: DictConfig) -> dict[str, Any]:
    """Run `mtp-precompute` with a composed config; returns the manifest's totals (on every rank)."""
    check_config(cfg, "precompute")
    pc = typed(cfg, PrecomputeConfig)  # a wrong value type fails here, before any process group or model
    if pc.backend == "vllm":
        return capture_main(cfg, pc)
    if pc.backend != "engine":
        raise ValueError(f"backend={pc.backend!r}: choose one of {', '.join(PRECOMPUTE_BACKENDS)}")
    with distributed(pc.model) as (info, stack):
        group = dist.cpu_group(timedelta(hours=24))
        out = Path(pc.out)
        if info.is_main:
            # Refuses a foreign `out` (or one holding a link out of it), then locks it, before any write.
            stack.enter_context(claim_output(out, PROG, overwrite=pc.overwrite))
            ensure_model(pc.model)  # one rank converts a missing default model; the others wait
        dist.barrier(group)
        tp_size = pc.model.tp
        if tp_size > 1:
            from mtp_train.data.chat import load_tokenizer
            from mtp_train.models.tensor_parallel import load_model_tp, tp_groups

            tp, dp_rank, dp_world = tp_groups(tp_size)
            model_path = Path(pc.model.path)
            model = load_model_tp(model_path, tp, dtype=pc.model.dtype, device=run_device(pc.model, info),
                                  backend=pc.model.backend)
            tokenizer = load_tokenizer(model_path)
        else:
            model, tokenizer, model_path = load_target(pc.model, run_device(pc.model, info))
            dp_rank, dp_world, tp = info.rank, info.world, None
        start = ConfigOnStart(cfg, out)
        manifest = run_precompute(model, tokenizer, model_path, pc, rank=dp_rank, world=dp_world,
                                  tp_rank=0 if tp is None else tp.rank, tp_size=tp_size,
                                  config_dict=to_dict(cfg), on_start=start)
        if manifest is None:
            return {"out": str(out), "rank": info.rank}
        t = manifest.totals
        result = {"out": str(out), "samples": t.samples, "tokens": t.tokens, "loss_tokens": t.loss_tokens,
                  "bytes": t.bytes, "shards": len(manifest.shards), "world": info.world}
        if not start.called:
            print(nothing_to_do(out, manifest), flush=True)
            return result
        print(f"{PROG}: {t.samples} samples, {t.tokens} tokens ({t.loss_tokens} assistant) in "
              f"{len(manifest.shards)} shards, {t.bytes / 2**20:.1f} MiB → {out}/manifest.json", flush=True)
        dropped = dropped_summary(manifest.data)
        if dropped:
            print(f"{PROG}: {dropped} (recorded under `data` in the manifest)", flush=True)
        return result


def capture_main(cfg: DictConfig, pc: PrecomputeConfig) -> dict[str, Any]:
    """`backend=vllm`: one process drives a vLLM engine it launches, or running servers
    (`mtp_train.precompute.vllm_backend`)."""
    if launch_env().world > 1:
        raise ValueError("backend=vllm runs in one process (vLLM spreads the work itself: vllm.tensor_parallel_size); "
                         "start it without torchrun")
    out = Path(pc.out)
    if pc.vllm.serve_command:
        print(serve_command(pc), flush=True)
        return {"out": str(out), "serve_command": True}
    if pc.vllm.endpoints:
        if not pc.vllm.spool_dir:
            raise ValueError("vllm.endpoints needs vllm.spool_dir: the folder those servers' connector writes to, as "
                             "this machine sees it (vllm.serve_command=true prints how to start them)")
    else:
        check_vllm_python(pc.vllm_python)  # before `out` is made: a missing venv leaves nothing behind
    start = ConfigOnStart(cfg, out)
    with claim_output(out, PROG, overwrite=pc.overwrite):
        ensure_model(pc.model)
        manifest = precompute_vllm(pc, environ=dict(os.environ), config_dict=to_dict(cfg), on_start=start)
    t = manifest.totals
    result = {"out": str(out), "samples": t.samples, "tokens": t.tokens, "loss_tokens": t.loss_tokens,
              "bytes": t.bytes, "shards": len(manifest.shards), "world": 1}
    if not start.called:
        print(nothing_to_do(out, manifest), flush=True)
        return result
    print(f"{PROG}: {t.samples} samples, {t.tokens} tokens ({t.loss_tokens} assistant) captured by vLLM in "
          f"{len(manifest.shards)} shards, {t.bytes / 2**20:.1f} MiB → {out}/manifest.json", flush=True)
    return result


class ConfigOnStart:
    """The run's `on_start`: saves its resolved config as `<out>/config.yaml` once the run is about to write, and
    remembers that it did (a run that never starts found its folder finished and wrote nothing).

    Args:
        cfg: the command's composed config.
        out: the run's output folder.
    """

    def __init__(self, cfg: DictConfig, out: Path) -> None:
        self.cfg, self.out, self.called = cfg, out, False

    def __call__(self) -> None:
        self.called = True
        save_config(self.cfg, self.out / "config.yaml")


def nothing_to_do(out: Path, manifest: Manifest) -> str:
    """The line of a run whose `out` already holds its finished folder.

    Args:
        out: the run's output folder.
        manifest: the folder's manifest, as the run found it.
    """
    t = manifest.totals
    made = manifest.provenance.get("settings", {}).get("backend", "engine")
    return (f"{PROG}: {out} already holds this precompute ({t.samples} samples in {len(manifest.shards)} shards, "
            f"backend={made}, finished {manifest.created_at}): nothing to do, nothing changed; overwrite=true "
            "redoes it")


main = hydra_entry(PROG, "precompute", precompute_main)


if __name__ == "__main__":
    main()
