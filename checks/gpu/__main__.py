"""`python -m checks.gpu [--model DIR]`: every group of the GPU check in one run (the package docstring lists them).

Run it through `bash launch/gpu_check.sh`, which first makes FlashInfer importable on a machine without an index.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from checks.gpu import __doc__ as GROUPS
from checks.gpu.backends import backend_checks, hf_parity_check
from checks.gpu.chain_attention import chain_attention_check
from checks.gpu.common import Checks, Target, random_checkpoint
from checks.gpu.cuda_graphs import BATCH1_GOAL, cuda_graph_checks
from checks.gpu.deepseek import deepseek_checks
from checks.gpu.speculative import speculative_checks
from checks.gpu.tensor_parallel import tensor_parallel_check
from checks.gpu.throughput import throughput
from checks.gpu.train_memory import train_memory_check
from checks.gpu.train_step import train_step_check
from checks.gpu.tree_mask import tree_mask_cost


def model_jobs(check: Checks, target: Target, goal: float | None) -> list[tuple[str, Callable[[], None]]]:
    """The per-model groups of one target, in order (named for the crash report)."""
    return [(f"{target.tag} backends", lambda: backend_checks(check, target)),
            (f"{target.tag} speculative", lambda: speculative_checks(check, target)),
            (f"{target.tag} cuda graphs", lambda: cuda_graph_checks(check, target, goal)),
            (f"{target.tag} transformers parity", lambda: hf_parity_check(check, target)),
            (f"{target.tag} throughput", lambda: throughput(target))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checks.gpu", description=GROUPS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("FAIL  cuda: no CUDA device")
        return 1
    import flashinfer

    print(f"INFO  torch {torch.__version__}, flashinfer {flashinfer.__version__}, {torch.cuda.get_device_name()}")
    check = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        small = random_checkpoint(Path(tmp) / "small", vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                  max_position_embeddings=2048, tie_word_embeddings=False)
        smol = Path(args.model)
        tag = "smollm2"
        if not (smol / "config.json").is_file():
            tag = "smollm2-shape(random)"
            smol = random_checkpoint(Path(tmp) / "smol", vocab_size=49152, hidden_size=576,
                                     intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                     num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                                     rms_norm_eps=1e-5, tie_word_embeddings=True)
        jobs = model_jobs(check, Target("small", small), None) + model_jobs(check, Target(tag, smol), BATCH1_GOAL)
        jobs.append(("deepseek-v2", lambda: deepseek_checks(check, Path(tmp))))
        jobs.append(("tree mask cost", lambda: tree_mask_cost(check, tag, smol)))
        jobs.append(("chain attention", lambda: chain_attention_check(check)))
        jobs.append(("train memory", lambda: train_memory_check(check, smol, Path(tmp) / "train-memory")))
        jobs.append(("train step", lambda: train_step_check(check, smol, Path(tmp) / "train-step")))
        if torch.cuda.device_count() > 1:
            jobs.append(("tensor parallel", lambda: tensor_parallel_check(check, Path(tmp), small)))
        else:
            print("INFO  one GPU: tensor parallelism is checked on machines with two or more")
        for name, job in jobs:
            try:
                job()
            except Exception as e:  # report and continue with the next group
                traceback.print_exc()
                check(f"{name} (crashed)", False, f"{type(e).__name__}: {e}")
    print(json.dumps({"passed": check.passed, "failed": check.failed}))
    return 0 if check.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
