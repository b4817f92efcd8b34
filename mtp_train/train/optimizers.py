"""The optimiser of `train.optimizer=muon`: torch's own `torch.optim.Muon` and `torch.optim.AdamW`, stepped as one.

Muon (momentum, then each 2-D update orthogonalised by Newton-Schulz iterations) is defined for weight matrices
only, so a head's parameters are split three ways, as speculators splits a draft model's:

    Muon                  every 2-D weight matrix whose dimensions both exceed 1 (fc, q/k/v/o, the MLP)
    AdamW at optim.lr     norms, biases, vectors and [1, N] matrices (optim.weight_decay, optim.betas, optim.eps)
    AdamW at muon_lr      vocabulary-indexed matrices (a head's own lm_head, dspark's Markov tables): skipped by
                          Muon for their shape (rows are tokens, not a linear map to orthogonalise), not because
                          they want a smaller step, so they keep the Muon group's rate and weight decay

DeepSpeed and the LR schedule take ONE optimiser, so `MuonWithAdamW` holds the two torch optimisers and shares
their param groups (the AdamW groups first: the trainer's train/lr is group 0's, optim.lr's schedule as under
AdamW). It computes no update of its own: `step` clips the global gradient norm (DeepSpeed's own clipping is off
for it, `deepspeed_config.build_ds_config(client_optimizer=True)`, because DeepSpeed reports no norm when it clips
an fp32 client optimiser) and calls each part's `step`.

Under DeepSpeed it runs without ZeRO (`deepspeed=zero0`; config.train refuses another stage): ZeRO hands the
optimiser flat 1-D partitions of the weights, and Muon needs each matrix whole. In fp32 (CPU) DeepSpeed steps it
as it is; in bf16 (CUDA) DeepSpeed keeps an fp32 master copy of each parameter in its own shape (its unfused
optimiser wrapper) and steps this optimiser on them.
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mtp_train.config import OptimConfig

VOCAB_MATRICES = ("lm_head", "embed", "markov_w1", "markov_w2")  # parameter names of vocabulary-indexed matrices


def split_for_muon(named: Iterable[tuple[str, nn.Parameter]]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The trainable parameters by the optimiser that takes them: {"muon": 2-D weight matrices, "adamw": norms,
    biases, vectors, "vocab": vocabulary-indexed matrices} (module docstring)."""
    parts: dict[str, list[tuple[str, nn.Parameter]]] = {"muon": [], "adamw": [], "vocab": []}
    for name, p in named:
        if not p.requires_grad:
            continue
        if p.ndim != 2 or min(p.shape) == 1:
            parts["adamw"].append((name, p))
        elif any(hint in name for hint in VOCAB_MATRICES):
            parts["vocab"].append((name, p))
        else:
            parts["muon"].append((name, p))
    return parts


class MuonWithAdamW(torch.optim.Optimizer):
    """`torch.optim.AdamW` and `torch.optim.Muon` stepped as one optimiser (module docstring).

    param_groups: the AdamW groups, then Muon's (the same dicts the parts hold, so a wrapper that swaps a group's
    params, or a schedule that sets its lr, reaches the part). grad_clip: clip the global gradient norm of every
    group's parameters to this before stepping (0 = off); the norm before clipping is `_global_grad_norm`, which
    DeepSpeed reports as the step's gradient norm.
    """

    def __init__(self, adamw: torch.optim.AdamW | None, muon: torch.optim.Muon | None, grad_clip: float = 0.0) -> None:
        self.parts: list[torch.optim.Optimizer] = [o for o in (adamw, muon) if o is not None]
        if not self.parts:
            raise ValueError("no parameter to optimise: the head has no trainable parameters")
        params = [p for o in self.parts for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.grad_clip = float(grad_clip)
        self._global_grad_norm: float | None = None
        self._share_parts()

    def _share_parts(self) -> None:
        """param_groups and state as views of the parts' (a part's load_state_dict replaces its own)."""
        self.param_groups = [g for o in self.parts for g in o.param_groups]
        self.state = ChainMap(*(o.state for o in self.parts))  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Clip the gradients (grad_clip), then step AdamW and Muon."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if params:
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else math.inf)
            self._global_grad_norm = float(norm)
        for o in self.parts:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """{"parts": [AdamW's state_dict, Muon's]} (the parts present, in param_groups' order)."""
        return {"parts": [o.state_dict() for o in self.parts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = state_dict.get("parts") if isinstance(state_dict, dict) else None
        if not isinstance(parts, list) or len(parts) != len(self.parts):
            raise ValueError(f"not a state of this optimiser ({len(self.parts)} parts: "
                             f"{', '.join(type(o).__name__ for o in self.parts)}); resume with the train.optimizer "
                             "the checkpoint was written with, or start afresh with resume=none")
        for o, sd in zip(self.parts, parts):
            o.load_state_dict(sd)
        self._share_parts()


def build_muon(module: nn.Module, optim: OptimConfig) -> MuonWithAdamW:
    """train.optimizer=muon over `module`'s trainable parameters: Muon on its 2-D weight matrices at optim.muon_lr,
    AdamW on the rest (module docstring), clipping at optim.grad_clip."""
    parts = split_for_muon(module.named_parameters())
    peak = optim.muon_peak_lr
    groups: list[dict[str, Any]] = []
    if parts["adamw"]:
        groups.append({"params": [p for _, p in parts["adamw"]], "lr": optim.lr, "weight_decay": optim.weight_decay})
    if parts["vocab"]:
        groups.append({"params": [p for _, p in parts["vocab"]], "lr": peak,
                       "weight_decay": optim.muon_weight_decay})
    adamw = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                              weight_decay=optim.weight_decay) if groups else None
    muon = torch.optim.Muon([p for _, p in parts["muon"]], lr=peak, weight_decay=optim.muon_weight_decay,
                            momentum=optim.muon_momentum, nesterov=optim.muon_nesterov, ns_steps=optim.muon_ns_steps,
                            adjust_lr_fn=optim.muon_adjust_lr_fn) if parts["muon"] else None
    return MuonWithAdamW(adamw, muon, optim.grad_clip)
