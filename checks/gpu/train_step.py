"""Training steps on CUDA: a block drafter's position-grouped token loss, and Muon under DeepSpeed in bf16.

1. `train.losses.unrolled_loss` of a `dflash` head (B 16) and a `dspark` head (B 4) on the check's target, on CUDA:
   the position-grouped token loss (the target's lm_head once per distinct position; the default) against the
   step-by-step path (`group_targets=False`), in float32 (loss and every gradient within 1e-3 relative: CUDA's
   matmuls reduce in other orders than the CPU tests' 1e-5) and in bf16 (within the check's `TOL`), for
   `loss.ce_impl` checkpoint and fused.
2. `mtp-train recipe=speculators-eagle3` (Muon on the matrices, AdamW on the rest, ZeRO 0, bf16 with DeepSpeed's
   fp32 masters, the frozen draft lm_head) for a few steps on a synthetic precompute folder: it finishes, every
   logged loss is finite, and the head's draft lm_head is still the target's rows (it never trains there).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from checks.gpu.common import TOL, Checks, rel_err
from mtp_train.config import HeadConfig
from mtp_train.config.head import default_aux_layers
from mtp_train.config.loss import LossConfig
from mtp_train.head_types.dflash.head import default_block_layers
from mtp_train.heads import FrozenTargetParts, build_head, load_head
from mtp_train.models.families import args_from_dir
from mtp_train.precompute.synthetic import make_folder
from mtp_train.train.losses import unrolled_loss

CASES = (("dflash", 16, {}), ("dspark", 4, {"markov_rank": 16}))


def _batch(rows: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows,), generator=g)
    mask = (torch.rand(rows, generator=g) < 0.8).to(torch.uint8)
    return ids.to(device), mask.to(device), [rows // 2, rows - rows // 2]


def grouped_loss_check(check: Checks, target: Path, device: str = "cuda", rows: int = 1024,
                       dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> None:
    """Item 1 of the module docstring (`device`, `rows` and `dtypes` are for a dry run on the CPU)."""
    for head_type, block, extra in CASES:
        for dtype in dtypes:
            torch.manual_seed(0)
            head = build_head(HeadConfig.of(type=head_type, block_size=block, max_anchors=rows // 8, **extra),
                              target, device=device, dtype=dtype).train()
            ids, mask, lens = _batch(rows, head.args.vocab_size, device)
            x = torch.randn(rows, head.input_width, device=device, dtype=dtype)
            hidden = torch.randn(rows, head.args.hidden_size, device=device, dtype=dtype)
            for ce_impl in ("checkpoint", "fused"):
                cfg = LossConfig(steps=head.drafts, w_feat=0.0, w_tok=1.0, position_weights="dpace", ce_impl=ce_impl,
                                 chunk_size=256)
                got = []
                for grouped in (True, False):
                    head.zero_grad(set_to_none=True)
                    loss, _ = unrolled_loss(head, hidden, ids, mask, lens, cfg, aux_hidden=x, anchor_seed=11,
                                            group_targets=grouped)
                    loss.backward()
                    got.append([loss.detach().float(), *(p.grad.float() for p in head.parameters()
                                                         if p.grad is not None)])
                tol = 1e-3 if dtype == torch.float32 else TOL
                err = max(rel_err(a, b) for a, b in zip(*got)) if len(got[0]) == len(got[1]) else float("inf")
                name = str(dtype).removeprefix("torch.")
                check(f"grouped token loss {head_type} B {block} {name} {ce_impl}: = the per-step path", err < tol,
                      f"max rel err {err:.2e} over the loss and {len(got[0]) - 1} gradients")


def muon_recipe_check(check: Checks, target: Path, work: Path, device: str = "cuda", length: int = 2048,
                      steps: int = 4) -> None:
    """Item 2 of the module docstring."""
    layers = args_from_dir(target).num_layers
    aux = sorted(set(default_aux_layers(layers)) | set(default_block_layers(layers)))
    folder = work / "data"
    if not (folder / "manifest.json").is_file():
        make_folder(folder, 8, target=target, aux_layers=aux, min_len=length // 2, max_len=length, val_fraction=0.0,
                    shard_tokens=max(65536, length), loss_fraction=1.0)
    out = work / "run"
    args = [f"model.path={target}", "recipe=speculators-eagle3", f"head.aux_layers=[{','.join(map(str, aux[:3]))}]",
            f"data.dir={folder}", f"out={out}", f"model.device={device}", f"train.max_steps={steps}",
            f"train.micro_batch_tokens={length}", "train.eval_batches=0", "train.save_every=0", "train.log_every=1",
            "train.progress=false", "optim.warmup_steps=1", "wandb.mode=disabled", "spec_eval.prompts=[]",
            "overwrite=true", "resume=none"]
    run = subprocess.run([sys.executable, "-m", "mtp_train.cli.train", *args], capture_output=True, text=True)
    metrics = out / "metrics.jsonl"
    if run.returncode or not metrics.is_file():
        check("muon recipe: mtp-train recipe=speculators-eagle3 runs", False, (run.stdout + run.stderr)[-1500:])
        return
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    losses = [v for r in rows for k, v in r.items() if k == "train/loss"]
    ok = len(losses) >= steps and all(torch.isfinite(torch.tensor(losses)))
    check("muon recipe: every logged loss finite", ok, f"train/loss {[round(v, 4) for v in losses]}")
    heads = sorted((out / "heads").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    if not heads:
        check("muon recipe: the frozen draft lm_head", False, f"no head folder under {out / 'heads'}")
        return
    head = load_head(heads[-1], target)
    rows_now = head.lm_head.weight.detach().float().cpu()
    targets = FrozenTargetParts.from_pretrained(target).lm_head.float()[head.draft_vocab.cpu().long()]
    err = rel_err(rows_now, targets)
    check("muon recipe: the draft lm_head is still the target's rows (head.train_lm_head=false)", err < TOL,
          f"rel err {err:.2e}")


def train_step_check(check: Checks, target: Path, work: Path) -> None:
    """Both items of the module docstring on CUDA."""
    grouped_loss_check(check, target)
    muon_recipe_check(check, target, work)
