"""The DFlash block drafter (z-lab; vLLM's `qwen3_dflash`): B tokens drafted by ONE forward of a few draft layers.

    c_p = hidden_norm(fc([a_p^1 ; ... ; a_p^k]))          the target's aux layers at context position p (k·H → H)
    K_p, V_p (per draft layer) = RoPE_p(k_norm(k_proj(c_p))), v_proj(c_p)      (no input_layernorm on c_p)
    x = E([t_a, m, m, ..., m])                             the block at positions a..a+B-1 (m = mask_token_id)
    x = x + o_proj(attn(q_norm/k_norm, RoPE; the block's rows over K/V of positions < a and of the whole block))
    x = x + mlp(post_attention_layernorm(x))               (input_layernorm before the attention, Qwen3's layer)
    out = norm(x)                                          slot s ≥ 1 estimates h_{a+s-1}: the draft of t_{a+s}

So the block of anchor a (its first token t_a, the last token of the sequence when drafting) drafts t_{a+1} ..
t_{a+B-1}. In the unroll contract (`mtp_train.heads.base`: row i of step j estimates h_{i+j+1}) the block of
anchor a is row i = a-1 and slot s = j+1 is step j, steps 0..B-2. Context K/V exist for every position of the
sequence and are computed once per batch (training) or once per accepted token (drafting: `speculative` keeps
them in the head's paged cache); the block attention is `heads/block_attention.py`.

The projections are `layers.linear.Linear` (nn.Linear's parameters and state dict): training takes `F.linear`,
drafting's few rows (B per sequence, the accepted tokens' context) the CPU fast paths that stream each weight
once, as the target's own decode does.

The layers are Qwen3-shaped for any Llama-family target (separate q/k/v/o projections without bias, q/k RMSNorm
per head, SwiGLU MLP of the target's intermediate size), full attention whatever the target's windows; the
embedding and lm_head are the target's, frozen. DeepSeek (MLA) targets list their head types and refuse it.

State dict (the z-lab names, `export.py`): fc.weight (H, k·H); hidden_norm.weight; layers.N.{input_layernorm,
post_attention_layernorm}.weight; layers.N.self_attn.{q,k,v,o}_proj.weight; layers.N.self_attn.{q,k}_norm.weight
(D,); layers.N.mlp.{gate,up,down}_proj.weight; norm.weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from mtp_train.config import HeadConfig
from mtp_train.heads.base import DraftHead
from mtp_train.heads.block_attention import BlockLayout, packed_block_attention
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.heads.packing import packed_shift, resolve_seq_lens
from mtp_train.heads.sequence import SequenceShard
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, KVLayout
from mtp_train.layers.linear import Linear
from mtp_train.layers.norm import RMSNorm
from mtp_train.layers.rotary import apply_rotary
from mtp_train.models.config import ModelArgs


def spread_slots(slots: torch.Tensor, idx: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """slots (A, S, W) each block's slots → per slot s, (rows, W) zeros with row idx[a] = slots[a, s]. One unbind
    takes the slots apart (its backward one stack of their (A, W) gradients), where indexing one slot at a time gave
    each slot's gradient a zero-filled copy of all the blocks' rows to add."""
    return [slots.new_zeros(rows, slots.shape[2]).index_copy_(0, idx, slot) for slot in slots.unbind(1)]


def default_block_layers(num_layers: int, count: int = 5) -> list[int]:
    """The aux layers of a DFlash head when head.aux_layers is [] (hidden_states numbering).

    z-lab's rule: `count` decoder layers spread evenly from layer 1 to layer L-3 (0-based), whose outputs are
    hidden_states[j+1]; fewer when a small target has fewer distinct layers there."""
    span = num_layers - 4
    ids = {min(max(round(1 + i * span / max(count - 1, 1)), 0), num_layers - 1) for i in range(count)}
    return sorted(j + 1 for j in ids)


class DFlashAttention(nn.Module):
    """Qwen3's attention for the block: q/k/v/o projections, per-head q/k RMSNorm, RoPE; K/V of the context from
    the target's normed features (`context_kv`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, d
        self.q_proj = Linear(h, args.num_heads * d, bias=False)
        self.k_proj = Linear(h, args.num_kv_heads * d, bias=False)
        self.v_proj = Linear(h, args.num_kv_heads * d, bias=False)
        self.o_proj = Linear(args.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps)
        self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx: (N, H) normed context features; cos, sin: (N, 1, D) at their positions → K, V (N, Hkv, D)."""
        n = ctx.shape[0]
        k = self.k_norm(self.k_proj(ctx).view(n, self.num_kv_heads, self.head_dim))
        return apply_rotary(k, cos, sin), self.v_proj(ctx).view(n, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, layout: BlockLayout, inverse: torch.Tensor | None = None) -> torch.Tensor:
        """x: (A, B, H) the blocks (after input_layernorm); cos, sin: (A·B, 1, D) → (A, B, H).

        With inverse (A·B,) long, x is (U, H) the blocks' distinct rows, block row r being x[inverse[r]]: the
        projections and the q/k norms run on the U rows (the first layer's [t_a, mask, ..., mask] blocks hold at
        most A + 1 distinct rows), the rows are spread out before RoPE, the only per-position step."""
        a = x.shape[0] if inverse is None else layout.ctx_len.shape[0]
        b = x.shape[1] if inverse is None else inverse.numel() // a
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        q = self.q_norm(self.q_proj(rows).view(n, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(rows).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(rows).view(n, self.num_kv_heads, self.head_dim)
        if inverse is not None:
            q, k, v = q[inverse], k[inverse], v[inverse]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = packed_block_attention(q.view(a, b, self.num_heads, self.head_dim),
                                     k.view(a, b, self.num_kv_heads, self.head_dim),
                                     v.view(a, b, self.num_kv_heads, self.head_dim), k_ctx, v_ctx, layout)
        return self.o_proj(out.reshape(a * b, -1)).view(a, b, -1)


class DFlashMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)), separate projections as the z-lab layout names them."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., H) → (..., H); the projections see (N, H) rows, the shape of the few-row fast paths."""
        rows = x.reshape(-1, x.shape[-1])
        return self.down_proj(F.silu(self.gate_proj(rows)) * self.up_proj(rows)).view(x.shape)


class DFlashLayer(nn.Module):
    """One draft layer: Qwen3's pre-norm decoder layer whose attention reads the context K/V besides the block."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = DFlashAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = DFlashMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, layout: BlockLayout, inverse: torch.Tensor | None = None) -> torch.Tensor:
        """x: (A, B, H) → (A, B, H); with inverse (A·B,), x is (U, H) the blocks' distinct rows
        (`DFlashAttention.forward`): the norm and the projections run on those, the residual on every row."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, layout, inverse)
        x = x.view(h.shape) if inverse is None else x[inverse].view(h.shape)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(DraftHead):
    """fc over the aux layers → hidden_norm → context K/V of `head.layers` draft layers; the block of
    [last token, mask × (B-1)] through them → norm → the target's lm_head."""

    type_name = "dflash"
    # `block` under autograd runs the first layer's token-only part once per distinct token (False: on every row,
    # the explicit path the tests compare it with)
    share_first_layer = True

    def __init__(self, cfg: HeadConfig, target_args: ModelArgs, frozen: FrozenTargetParts | None = None,
                 backend: str = "torch") -> None:
        super().__init__(cfg, target_args, frozen, backend)
        a = self.args
        h = a.hidden_size
        self.block_size = self.cfg.settings.block_size
        mask = self.cfg.settings.mask_token_id
        self.mask_token_id = a.vocab_size - 1 if mask is None else mask
        if not 0 <= self.mask_token_id < a.vocab_size:
            raise ValueError(f"head.mask_token_id={self.mask_token_id} is not a token of the target's vocabulary "
                             f"(0..{a.vocab_size - 1})")
        self.fc = Linear(self.input_width, h, bias=False)
        self.hidden_norm = RMSNorm(h, a.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(a) for _ in range(self.cfg.settings.layers))
        self.norm = RMSNorm(h, a.rms_norm_eps)

    @property
    def kv_shape(self) -> tuple[int, KVLayout]:
        """One K/V layer per draft layer, the context's (the block's own K/V are never cached)."""
        return self.cfg.settings.layers, KVLayout(self.args.num_kv_heads, self.args.head_dim)

    def features(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: torch.Tensor | None, attn: AttentionBackend, *, from_target: bool) -> torch.Tensor:
        raise ValueError("a dflash head drafts a whole block from its context (`DFlashHead.block`, its drafter "
                         "`head_types/dflash/drafter.py`); it has no per-row forward")

    # -- the block forward, shared by training and drafting --

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: (N, k·H) the target's aux layers at context positions → (N, H) hidden_norm(fc(aux))."""
        return self.hidden_norm(self.fc(self.aux_input(aux.to(self.dtype))))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx: (N, H) from `context`; positions: (N,) → per draft layer (K, V), each (N, Hkv, D)."""
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def block(self, tokens: torch.Tensor, positions: torch.Tensor,
              ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: BlockLayout,
              checkpoint: bool = False) -> torch.Tensor:
        """The blocks' output features.

        Args:
            tokens: (A, B) each block's ids [t_a, mask, ..., mask].
            positions: (A, B) a..a+B-1.
            ctx_kv: per draft layer, the packed context (K, V) (N, Hkv, D) the layout's groups index.
            layout: which context rows each block sees.
            checkpoint: run each draft layer under non-reentrant `torch.utils.checkpoint` (training with
                train.activation_checkpointing: its activations are recomputed in the backward, not kept).
        Returns (A, B, H) after the final norm: slot s estimates h_{a+s-1} (slot 0 is not a draft).
        """
        a, b = tokens.shape
        inverse = None
        if self.share_first_layer and torch.is_grad_enabled() and tokens.numel():
            # training: the blocks [t_a, mask, ..., mask] repeat their mask rows A·(B-1) times, and until the first
            # attention a row depends on its token alone: the first layer's norm, q/k/v projections and q/k norms
            # run once per distinct token (at most A + 1 rows, not A·B), forward and backward
            uniq, inverse = torch.unique(tokens.reshape(-1), return_inverse=True)
            x = self.embed(uniq)  # (U, H)
        else:
            x = self.embed(tokens.reshape(-1)).view(a, b, -1)
        cos, sin = self.rope(positions.reshape(-1), x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            if checkpoint:
                x = torch_checkpoint(layer, x, cos, sin, k, v, layout, inverse, use_reentrant=False)
            else:
                x = layer(x, cos, sin, k, v, layout, inverse)
            inverse = None  # (A, B, H) from here on
        return self.norm(x)

    def block_tokens(self, first: torch.Tensor) -> torch.Tensor:
        """first: (A,) each block's first token → (A, B) [first, mask, ..., mask]."""
        out = torch.full((first.shape[0], self.block_size), self.mask_token_id, dtype=torch.long,
                         device=first.device)
        out[:, 0] = first
        return out

    def probe_features(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """(T, k·H), (T,) one sequence → (T, (B-1)·H) the block of every anchor, its slots side by side."""
        return torch.cat(self.unroll(hidden, token_ids, [hidden.shape[0]], self.drafts), dim=-1)

    # -- training --

    def loss_rows(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  seq_lens: Sequence[int] | torch.Tensor, seed: int | None = None) -> torch.Tensor:
        """(T,) bool, the rows i whose block (anchor a = i+1) trains: anchors among the loss positions, at most
        head.max_anchors per batch, drawn by a generator seeded from `seed` (the trainer passes one per step and
        micro-batch, `train.losses.step_anchor_seed`, so a batch seen again in a later epoch trains other anchors), or
        from the batch's tokens when None (evaluation: the same anchors every time). Either way the same arguments
        draw the same rows: the trainer's counts, the loss and every sequence-parallel rank pick the same ones."""
        lens = resolve_seq_lens(input_ids.shape[0], seq_lens)
        eligible = packed_shift(loss_mask.to(torch.bool), lens, 1, fill=False)
        idx = eligible.nonzero().squeeze(1)
        most = self.cfg.settings.max_anchors
        if idx.numel() > most:
            if seed is None:
                ids = input_ids.detach().to("cpu", torch.long).numpy()
                seed = int(np.random.SeedSequence([int(t) for t in ids[:4096]] + [len(ids)]).generate_state(1)[0])
            pick = torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(seed))[:most]
            idx = idx[pick.to(idx.device)]
        rows = torch.zeros_like(eligible)
        rows[idx] = True
        return rows

    @property
    def drafts(self) -> int:
        """Tokens one block drafts: B-1 (slot s >= 1 drafts t_{a+s}; a DSpark block drafts B)."""
        return self.block_size - 1

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
               steps: int, attention: str = "chain", chain_mode: str = "diagonal",
               rows: torch.Tensor | None = None, *, shard: SequenceShard | None = None,
               checkpoint: bool = False) -> list[torch.Tensor]:
        """The blocks of a packed batch, one per anchor, as `steps` (T, ·) tensors (module docstring).

        Args:
            hidden: (T, k·H) the target's aux layers (this rank's rows (T/N, k·H) under a shard).
            input_ids: (T,) the sequences' tokens t_i.
            seq_lens: (B,) the packed sequences' lengths.
            steps: 1..`drafts`: step j is the block's (j+1)-th draft (`slot_outputs`).
            attention, chain_mode: unused (a block does not chain).
            rows: (T,) bool, the rows whose block to compute (`loss_rows`); None = every row with a next token.
            shard: sequence parallelism (`heads/sequence.py`): input_ids, seq_lens and rows describe the padded
                batch whole, hidden and the returned tensors are this rank's rows, whose anchors' blocks it runs.
            checkpoint: recompute each draft layer in the backward (`block`).
        Rows without a block are zeros (the loss counts only `loss_rows`).
        """
        if not 1 <= steps <= self.drafts:
            raise ValueError(f"a {self.type_name} head of block_size {self.block_size} drafts {self.drafts} tokens "
                             f"per block; loss.steps={steps} (1..{self.drafts})")
        self.check_input(hidden, True)
        row_idx, out = self.anchor_blocks(hidden, input_ids, seq_lens, rows, shard=shard, checkpoint=checkpoint)
        span = (0, input_ids.shape[0]) if shard is None else (shard.lo, shard.hi)
        return self.slot_outputs(out, row_idx, input_ids, steps, span)

    def anchor_blocks(self, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
                      rows: torch.Tensor | None = None, *, shard: SequenceShard | None = None,
                      checkpoint: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The block of every anchor a = i+1 of the rows i selected (`unroll`'s arguments) →
        (row_idx (A,) long ascending, the blocks' outputs (A, B, H)).

        Under a shard: the context K/V of every draft layer are computed on this rank's rows and all-gathered over
        the group (each block reads its sequence's context before its anchor, wherever those rows lie), and the
        blocks are those of the selected rows in this rank's slice; row_idx stays a row of the whole batch."""
        lens = resolve_seq_lens(input_ids.shape[0], seq_lens)
        dev = hidden.device
        total = input_ids.shape[0]
        len_t = torch.tensor(lens, device=dev)
        starts = torch.cumsum(len_t, 0) - len_t
        seq_of = torch.repeat_interleave(torch.arange(len(lens), device=dev), len_t)  # (T,)
        pos = torch.arange(total, device=dev) - starts[seq_of]  # position within its sequence
        sel = packed_shift(torch.ones(total, dtype=torch.bool, device=dev), lens, 1, fill=False)
        if rows is not None:
            sel = sel & rows.to(dev)
        lo, hi = (0, total) if shard is None else (shard.lo, shard.hi)
        if hidden.shape[0] != hi - lo:
            raise ValueError(f"{hidden.shape[0]} hidden rows for rows [{lo}, {hi}) of the batch")
        sel[:lo] = False  # this rank's anchors only
        sel[hi:] = False
        row_idx = sel.nonzero().squeeze(1)  # (A,) ascending: anchors grouped by sequence
        anchors = pos[row_idx] + 1
        counts = torch.bincount(seq_of[row_idx], minlength=len(lens)).tolist()
        groups, a0 = [], 0
        for s, (n, c) in enumerate(zip(lens, counts)):
            if c:
                groups.append((a0, a0 + c, int(starts[s]), int(starts[s]) + n))
            a0 += c
        layout = BlockLayout(tuple(groups), anchors)
        ctx_kv = self.context_kv(self.context(hidden), pos[lo:hi])
        if shard is not None:  # every rank's context rows, in batch order (the layout indexes the whole batch)
            ctx_kv = [(shard.gather_rows(k), shard.gather_rows(v)) for k, v in ctx_kv]
        tokens = self.block_tokens(input_ids[row_idx + 1])
        positions = anchors[:, None] + torch.arange(self.block_size, device=dev)
        return row_idx, self.block(tokens, positions, ctx_kv, layout, checkpoint)  # (A, B, H)

    def slot_outputs(self, out: torch.Tensor, row_idx: torch.Tensor, input_ids: torch.Tensor,
                     steps: int, span: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """The blocks' outputs out (A, B, H) of rows row_idx (A,) → per step j, (R, H): slot j+1 at its row, over
        the batch's rows span = [lo, hi) (default all; a sequence shard's own rows), R = hi - lo."""
        lo, hi = (0, input_ids.shape[0]) if span is None else span
        return spread_slots(out[:, 1:steps + 1], row_idx - lo, hi - lo)
