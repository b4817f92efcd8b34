"""The P-EAGLE head (AWS, arXiv:2602.01469, "P-EAGLE: parallel drafting EAGLE"): EAGLE-3's layer drafting k tokens
in ONE forward, as vLLM's `eagle3` method runs it with `parallel_drafting` (`vllm/v1/spec_decode/llm_base_proposer.py`).

The layer, fc, norms and lm_head are EAGLE-3's (`head_types/eagle3/head.py`); what P-EAGLE adds is the input of the rows
after the first draft, the *slots*:

    row L-1 (depth 0)         g = fc(a_{L-1}), token t_L           (the target's aux layers: EAGLE-3's step 0)
    slot d = 1..k-1           g = fc(mask_hidden), token m         (m = mask_token_id, the placeholder token)
    position                  L-1+d
    attends                   every depth-0 row 0..L-1 and the slots 1..d (causal over one forward)
    logits                    lm_head(norm(x)) of row L-1 gives d_1, of slot d gives d_{d+1}

`mask_hidden` (k·H,) is a learned placeholder for the target's aux features (vLLM's `mask_hidden` buffer, which it
projects through `combine_hidden_states`, i.e. the same fc and, with head.aux_norm, the same per-layer norms); the
placeholder token's embedding is the target's frozen one. A slot never reads another slot's output: the k drafts
are independent of each other given the context, so one forward gives them all.

Training (`unroll`; the references: speculators' `PEagleDraftModel`, ModelOpt's and SpecForge's P-EAGLE) runs every
row as an anchor: step 0 is EAGLE-3's step 0 over the sequence; step j > 0 is slot j of every anchor i at position
i+j, reading (m, mask_hidden), attending to the depth-0 rows 0..i of its sequence and to its own anchor's slots
1..j. That mask is EAGLE-3's training-time test attention exactly (`heads/chain_attention.py`: step j of row i
sees step 0's keys of rows 0..i and its own keys of steps 1..j), so the unroll is `ChainHead.unroll` with the
slots' inputs in place of the chain's (row i of step j estimates h_{i+j+1}, the contract every head type shares).
The references thin the deeper depths by COD sampling (depth d keeps a random r^d share of the anchors) to bound
their dense attention masks; the chain attention here keeps nothing quadratic, so every anchor trains at every
depth.

State dict: eagle3's (`head_types/eagle3/head.py`) plus `mask_hidden` (k·H,).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mtp_train.config import HeadConfig
from mtp_train.head_types.eagle3.head import Eagle3Head
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.heads.sequence import SequenceShard
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, MLABackend
from mtp_train.models.config import ModelArgs


class PEagleHead(Eagle3Head):
    """EAGLE-3's head whose rows after the first draft read a learned placeholder: k drafts in one forward."""

    type_name = "peagle"
    norm_output = False  # no step reads another's output: P-EAGLE has no head.norm_output

    def __init__(self, cfg: HeadConfig, target_args: ModelArgs, frozen: FrozenTargetParts | None = None,
                 backend: str = "torch") -> None:
        super().__init__(cfg, target_args, frozen, backend)
        # The placeholder token (head.mask_token_id; null = the target's last vocabulary id, as dflash's default
        # mask token), whose frozen embedding every slot reads; the learned mask_hidden carries what a slot has of
        # its own.
        mask = self.cfg.settings.mask_token_id
        self.mask_token_id = target_args.vocab_size - 1 if mask is None else mask
        if not 0 <= self.mask_token_id < target_args.vocab_size:
            raise ValueError(f"head.mask_token_id={self.mask_token_id} is not a token of the target's vocabulary "
                             f"(0..{target_args.vocab_size - 1})")
        # Standard normal, as speculators start it: the scale of the target's aux features, which the fc reads too.
        self.mask_hidden = nn.Parameter(torch.randn(self.input_width))

    def slot_inputs(self, rows: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What `rows` slot rows read: (rows, k·H) mask_hidden and (rows,) the placeholder token, both fed to
        `features` as rows from the target (through the fc, as vLLM's `combine_hidden_states` projects it)."""
        dev = self.mask_hidden.device if device is None else device
        hidden = self.mask_hidden.to(dev).unsqueeze(0).expand(rows, -1)
        return hidden, torch.full((rows,), self.mask_token_id, dtype=torch.long, device=dev)

    def probe_features(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """(T, k·H), (T,) one sequence → (T, 2H): every anchor's depth-0 feature and its first slot's, side by side
        (the slots share every weight, and only they read mask_hidden): what an export's round trip compares."""
        return torch.cat(self.unroll(hidden, token_ids, [hidden.shape[0]], 2), dim=-1)

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
               steps: int, attention: str = "chain", chain_mode: str = "diagonal", *,
               shard: SequenceShard | None = None, checkpoint: bool = False) -> list[torch.Tensor]:
        """Depth 0 and the slots 1..steps-1 of every anchor (module docstring), as `ChainHead.unroll` runs a chain
        (its arguments; `shard` and `checkpoint` as there). Row i of step j estimates h_{i+j+1}."""
        if attention != "chain":
            raise ValueError(f"a peagle head's slots attend to the depth-0 rows up to their anchor and to the slots "
                             f"before them (the chain attention); loss.unroll_attention={attention} would hide the "
                             "context from them: set loss.unroll_attention=chain")
        return super().unroll(hidden, input_ids, seq_lens, steps, attention, chain_mode, shard=shard,
                              checkpoint=checkpoint)

    def _unroll_step(self, x: torch.Tensor, tokens: torch.Tensor, meta: AttentionMetadata, own: AttentionMetadata,
                     attn: AttentionBackend | MLABackend, step: int) -> torch.Tensor:
        """Step `step` of the unroll: step 0 EAGLE-3's over the target's rows; a later step the slot of that depth
        of every anchor, reading (mask_hidden, m) instead of the previous step's output and the next token."""
        if step > 0:
            x, tokens = self.slot_inputs(tokens.shape[0], tokens.device)
        begin = getattr(attn, "begin_step", None)  # the chain attention keeps keys per step
        if begin is not None:
            begin(step)
        attn.prepare(meta)
        return self.features(x, tokens, own, None, attn, from_target=True)
