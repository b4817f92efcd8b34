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

Training thins the deeper depths by COD sampling, as the references do (`loss_rows`; speculators'
`generate_cod_sample_indices`, the paper's section on training): of a micro-batch's n loss positions, depth d >= 1
trains floor((n - d) · max(r^d, r_min)) anchors (head.down_sample_ratio r, head.down_sample_ratio_min r_min; 0.7
and 0.2 as speculators'), drawn uniformly among the anchors depth d - 1 trained whose depth-d target is a loss
position (all of them when fewer), so an anchor trains depths 0..c-1 for its own c. The draw weighs the depths as
the references do (each depth's loss is the mean over its own rows, and a deeper depth's mean rests on fewer of
them) and bounds the loss's lm_head work; their dense masks needed it for memory, the chain attention here keeps
nothing quadratic and computes every anchor's slots, so the rows not drawn are dropped before the loss (none of
them is in it or in its counts).

State dict: eagle3's (`head_types/eagle3/head.py`) plus `mask_hidden` (k·H,).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mtp_train.config import HeadConfig
from mtp_train.head_types.eagle3.head import Eagle3Head
from mtp_train.heads import packed_shift, resolve_seq_lens
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

    def loss_rows(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  seq_lens: Sequence[int] | torch.Tensor, seed: int | None = None) -> torch.Tensor | None:
        """COD sampling (module docstring): (T,) long, row i trains the depths j < rows[i] (every row depth 0), or
        None with head.down_sample_ratio=1 (every anchor at every depth).

        The draw is depth by depth from one generator seeded from `seed` (the trainer's per step and micro-batch,
        `train.losses.step_anchor_seed`: the trainer's counts, the loss and every sequence-parallel rank draw the same
        rows), or from the batch's tokens when None. Row i at depth j predicts position i+j+1 of its sequence; n
        counts the rows depth 0 trains (a loss position after them); an anchor stays a candidate while its next
        depth's target is a loss position of its own sequence."""
        s = self.cfg.settings
        if not s.samples:
            return None
        lens = resolve_seq_lens(input_ids.shape[0], seq_lens)
        mask = loss_mask.to(torch.bool)
        total, dev = mask.shape[0], mask.device
        n = int(packed_shift(mask, lens, 1, fill=False).sum())
        # run[i]: how many depths j >= 1 in a row have a loss position as row i's target (positions i+2, i+3, ...)
        idx = torch.arange(total, device=dev)
        len_t = torch.tensor(lens, dtype=torch.long, device=dev)
        ends = torch.repeat_interleave(torch.cumsum(len_t, 0), len_t)  # (T,) the end of each row's sequence
        off = torch.where(mask, total, idx).flip(0).cummin(0).values.flip(0)  # first non-loss position >= p
        span = torch.minimum(off, ends) - idx  # loss positions from p on, within p's sequence
        run = torch.zeros(total, dtype=torch.long, device=dev)
        ok = idx + 2 < ends
        run[ok] = span[idx[ok] + 2]
        if seed is None:
            ids = input_ids.detach().to("cpu", torch.long).numpy()
            seed = int(np.random.SeedSequence([int(t) for t in ids[:4096]] + [len(ids), 0xC0D]).generate_state(1)[0])
        gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
        r, r_min = s.down_sample_ratio, s.down_sample_ratio_min

        def keep(d: int) -> int:  # the anchors depth d trains at most (non-increasing in d)
            return int(max(0, n - d) * max(r**d, r_min))

        depths = torch.ones(total, dtype=torch.long, device=dev)
        pool = (run >= 1).nonzero().squeeze(1)  # depth 1's candidates
        d = 1
        while pool.numel() and keep(d) > 0:
            if pool.numel() <= keep(int(run[pool].max())):
                # no depth from here to the deepest these rows reach draws (the pool only shrinks, keep(d) only
                # falls): each row goes on while its targets are loss positions
                depths[pool] = run[pool] + 1
                break
            if pool.numel() > keep(d):
                pool = pool[torch.randperm(pool.numel(), generator=gen)[:keep(d)].to(dev)]
            depths[pool] = d + 1
            d += 1
            pool = pool[run[pool] >= d]
        return depths

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
               steps: int, attention: str = "chain", chain_mode: str = "diagonal", rows: torch.Tensor | None = None,
               *, shard: SequenceShard | None = None, checkpoint: bool = False) -> list[torch.Tensor]:
        """Depth 0 and the slots 1..steps-1 of every anchor (module docstring), as `ChainHead.unroll` runs a chain
        (its arguments; `shard` and `checkpoint` as there). Row i of step j estimates h_{i+j+1}. rows: the COD draw
        (`loss_rows`); every row is computed whatever it says (the loss drops those not drawn)."""
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
