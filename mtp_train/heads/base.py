"""The draft-head interface, `DraftHead`: its two forward modes, its training unroll, the frozen lm_head; and
`ChainHead`, the heads that draft a chain one forward per token (mtp, eagle1, eagle3) with their chained unroll.

Notation: target hidden after the final norm `h_i` at position i, token `t_i`; the target's logits
`lm_head(h_i)` predict `t_{i+1}`. A head row at position i reads `h_i` and the embedding of `t_{i+1}` (the
token buffer is shifted one left against the hidden states) and predicts `h_{i+1}`, hence the
distribution of `t_{i+2}` through the frozen lm_head.

One module serves both modes:

* training: `forward_train` runs a packed batch of whole sequences with causal attention and no KV cache
  (the torch backend, so autograd works); `unroll` gives several steps' predictions (a `ChainHead` chains it);
* inference: `forward` runs any engine step (prefill, decode, verify) against the head's own one-layer
  paged KV pool, which uses the same page ids as the target.

Unrolled alignment, every head type's (a sequence of n tokens, rows i = 0..n-1, steps j = 0..k-1); the inputs and
attention below are a `ChainHead`'s:

    step j, row i   hidden in  h_i (j = 0)  or  out_{j-1}[i] (j > 0: the head's estimate of h_{i+j})
                    token in   t_{i+j+1}
                    position   i + j (the position of the draft step: the chain started at i)
                    predicts   h_{i+j+1}  and the distribution of t_{i+j+2}
                    counted    iff i+j+1 <= n-1 and loss_mask[i+j+1] = 1 (see mtp_train.train.losses)
                    attends    "chain" (default): step 0's keys of rows 0..i and its own keys of steps 1..j,
                               i.e. exactly what draft step j at position i+j sees at inference, where the
                               head's cache holds entries computed from the target's hidden states up to i
                               and the chain's own entries after it (EAGLE-3's "training-time test");
                               "causal": the rows 0..i of step j itself (DeepSeek-V3 MTP training), whose
                               inputs are all the head's own estimates.

An aux head (`features=aux`: eagle3, or mtp / eagle1 with head.features=aux) reads at step 0 the target's aux
layers at position i, concatenated (T, k·H), in place of h_i; targets stay h_{i+j+1}. eagle3's output feature (fed
to step j+1) is its layer output before the final norm, as vLLM and SGLang feed it; `logit_input` applies the norm.
EAGLE-3.1's two switches: `head.aux_norm` RMS-norms each aux layer's H-slice before the fc (`aux_input`, any aux
head), and `head.norm_output` (eagle3) makes the output feature the normed one (`logit_input` is then the identity);
both act inside `features`, so training (`forward_train`, `unroll`) and inference (`forward`) see them alike.

The last j+1 rows of each sequence have no token t_{i+j+1}: they are fed token id 0 and never counted; no
counted row attends to them (packing: `heads/packing.py`; the chain's attention: `heads/chain_attention.py`).

The head's block, attention backend, KV layout and RoPE are those of the target's family
(`mtp_train.models.families`): a Llama-family decoder layer over K/V pages, or DeepSeek's MLA block over latent rows.
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from mtp_train.config.device import on_cpu
from mtp_train.config.head import HeadConfig, HeadTypeSpec
from mtp_train.config.loss import UNROLL_ATTENTION
from mtp_train.heads.chain_attention import chain_attention
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.heads.packing import packed_shift, resolve_seq_lens
from mtp_train.heads.sequence import SequenceShard, ulysses_heads
from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, KVLayout, MLABackend
from mtp_train.layers.linear import (
    Linear,
    PlanMemo,
    gemv_avx512,
    gemv_operand,
    gemv_weight,
    linear,
    stream_linears,
    streaming_generation,
    tensor_version,
    weight_copy,
)
from mtp_train.layers.norm import RMSNorm
from mtp_train.layers.rotary import RotaryEmbedding
from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.families import family_of, titles


class HeadOutput(NamedTuple):
    """What the inference forward returns (T = rows of the step, N = requested logit rows)."""

    hidden: torch.Tensor  # (T, H) the head's output feature: the estimate of h_{i+1}, fed to the next draft step
    logits: torch.Tensor | None  # (N, V) at the requested rows, else None


class DraftHead(nn.Module, ABC):
    """A draft head over a frozen target: trainable layers here, frozen embedding and lm_head in `self.frozen`.

    `self.frozen` is a plain attribute, not a registered submodule or buffer, so `parameters()`,
    `state_dict()`, `.to()` and any training engine see only the head's own weights.
    """

    type_name: ClassVar[str] = "base"  # its HEAD_TYPES name (`mtp_train.config.head`): the type's settings
    num_kv_layers: ClassVar[int] = 1  # layers in the head's own paged KV pool

    def __init__(self, cfg: HeadConfig, target_args: ModelArgs, frozen: FrozenTargetParts | None = None,
                 backend: str = "torch") -> None:
        super().__init__()
        if cfg.type != self.type_name:
            raise ValueError(f"{type(self).__name__} needs a HeadConfig of type {self.type_name!r}, got {cfg.type!r}")
        family = family_of(target_args)
        if family.head_types is not None and cfg.type not in family.head_types:
            takes = titles(lambda f: f.head_types is None or cfg.type in f.head_types)
            raise ModelConfigError(f"{cfg.type} heads take {takes} targets; a {family.title} target takes an "
                                   f"{' or '.join(family.head_types)} head ({family.head_note})")
        spec = cfg.spec
        if spec.draft_vocab_required and cfg.draft_vocab_size > target_args.vocab_size:
            cfg = dataclasses.replace(cfg, draft_vocab_size=target_args.vocab_size)
        self.cfg = cfg.resolved(target_args.num_layers)  # aux_layers resolved too
        self.target_args = target_args
        self.args = dataclasses.replace(target_args, num_layers=1)  # the head's decoder: target shapes, one layer
        self.frozen = frozen
        self.backend_name = backend
        a = self.args
        # EAGLE-3.1 (head.aux_norm): one RMSNorm per aux layer, on its H-slice of step 0's input (`aux_input`).
        self.aux_norm = (nn.ModuleList(RMSNorm(a.hidden_size, a.rms_norm_eps) for _ in self.aux_layers)
                         if self.cfg.aux_norm else None)
        # Training always uses the torch backend (SDPA supports autograd); inference uses `backend`, per device.
        self._train_attn = self._make_attention("torch", torch.device("cpu"), None)
        self._attn: dict[torch.device, AttentionBackend | MLABackend] = {}
        # RoPE frequencies outside the module tree: an engine that casts the module to bf16 must not round them.
        self._rotary: dict[torch.device, RotaryEmbedding] = {}
        n = self.cfg.draft_vocab_size
        if n > a.vocab_size:
            raise ValueError(f"draft_vocab_size {n} exceeds the target's vocabulary ({a.vocab_size})")
        self.draft_vocab: torch.Tensor | None
        if 0 < n < a.vocab_size or (n > 0 and spec.draft_vocab_required):
            # Target token ids of the draft vocabulary, ascending; set from data with `set_draft_vocab`.
            self.register_buffer("draft_vocab", torch.arange(n, dtype=torch.long))
        else:
            self.draft_vocab = None
        self._lm_head_rows: tuple[tuple[int, int, int, torch.device, torch.dtype], torch.Tensor] | None = None
        self._stream: str | None = None  # inference streams copies of the weights of this kind (`stream_weights`)
        self._lm_w16: tuple[tuple, torch.Tensor] | None = None  # ((data_ptr, version, kind), copy) of the lm rows

    # -- what a head type implements --

    @abstractmethod
    def features(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: torch.Tensor | None, attn: AttentionBackend | MLABackend, *,
                 from_target: bool) -> torch.Tensor:
        """The head's output feature for every row.

        Args:
            hidden: (T, `input_width`) the target's features when `from_target` (h_i, or an aux head's k aux
                layers concatenated), else (T, H) the head's own previous output (a chained draft step).
            token_ids: (T,) the token that follows each row (t_{i+1}).
            meta: the step's metadata, already prepared for `attn` (an MLABackend for a DeepSeek block).
            kv_cache: the head's one-layer pool (num_pages, 2, page_size, Hkv, D), or (num_pages, page_size, C + R)
                latent rows for a DeepSeek block, written at the step's slots, or None.
            from_target: the caller's word on which input this is (never guessed from the width: one aux layer
                is H wide too, and still goes through the aux fc).
        Returns (T, H): the estimate of h_{i+1}.
        """

    def aux_input(self, aux: torch.Tensor) -> torch.Tensor:
        """(T, k·H) step 0's aux features → (T, k·H) what the aux fc reads: with head.aux_norm (EAGLE-3.1) each
        layer's H-slice through its own RMSNorm (the target's layers differ in scale), else unchanged."""
        if self.aux_norm is None:
            return aux
        chunks = aux.split(self.args.hidden_size, dim=-1)
        return torch.cat([norm(c.contiguous()) for norm, c in zip(self.aux_norm, chunks, strict=True)], dim=-1)

    def logit_input(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output feature (N, H) → what its lm_head reads (N, H): itself (mtp, eagle1), or the final
        norm of a head that feeds its pre-norm output to the next step (eagle3). Also what the feature loss
        compares with the target's hidden state."""
        return out

    def draft_lm_head(self) -> torch.Tensor:
        """(Vd, H) the projection of the head's logits: the frozen target rows (`lm_head_weight`) unless the head
        trains its own (eagle3)."""
        return self.lm_head_weight()

    def init_from_target(self, target_dir: str | Path) -> None:
        """Copy target weights into the head (HeadConfig.init = last_layer | target_mtp, as the type's spec takes
        them: `HeadTypeSpec.inits`); heads without such init refuse."""
        raise NotImplementedError(f"{self.type_name} heads cannot be initialised from the target")

    # -- shared machinery --

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def kv_shape(self) -> tuple[int, KVLayout]:
        """(num_layers, layout) of the head's KV pool: `KVCache(layers, num_pages, page_size, layout, ...)`.

        The layout is the target's: K/V pages, or MLA's latent rows for a DeepSeek block.
        """
        return self.num_kv_layers, self.args.kv_layout

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def attach(self, frozen: FrozenTargetParts) -> None:
        """Use these frozen target parts (e.g. moved to another device / dtype)."""
        if frozen.args.hidden_size != self.args.hidden_size or frozen.args.vocab_size != self.args.vocab_size:
            raise ValueError(f"frozen parts of shape (V={frozen.args.vocab_size}, H={frozen.args.hidden_size}) do "
                             f"not fit a head for (V={self.args.vocab_size}, H={self.args.hidden_size})")
        self.frozen = frozen

    def require_frozen(self) -> FrozenTargetParts:
        """The attached frozen target parts; a clear error when there are none."""
        if self.frozen is None:
            raise RuntimeError("no frozen target parts attached: build the head with build_head/load_head "
                               "or call head.attach(FrozenTargetParts.from_pretrained(target_dir))")
        return self.frozen

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: (T,) → (T, H) frozen target embeddings, in the head's dtype."""
        return self.require_frozen().embed_tokens(token_ids).to(self.dtype)

    @property
    def aux_layers(self) -> list[int]:
        """Target layers (hidden_states numbering) whose states, concatenated, are step 0's input; [] = the final
        hidden (features=final)."""
        return list(self.cfg.aux_layers) if self.cfg.features == "aux" else []

    @property
    def spec(self) -> HeadTypeSpec:
        """The registered spec of the head's type (norm defaults, features, draft vocabulary, formats)."""
        return self.cfg.spec

    @property
    def input_width(self) -> int:
        """Width of step 0's input rows: k·H for k aux layers, else H (the spec's rule)."""
        return self.spec.input_width(self.cfg.features, len(self.aux_layers), self.args.hidden_size)

    def check_input(self, hidden: torch.Tensor, from_target: bool) -> None:
        """Refuse rows of the wrong width for their kind: (T, input_width) from the target, (T, H) from the head."""
        width = self.input_width if from_target else self.args.hidden_size
        if hidden.dim() != 2 or hidden.shape[-1] != width:
            kind = (f"the target's {'aux layers ' + str(self.aux_layers) if self.aux_layers else 'final hidden'}"
                    if from_target else "the head's own output")
            raise ValueError(f"the {self.type_name} head reads {kind} as (T, {width}) rows, got "
                             f"{tuple(hidden.shape)}")

    @property
    def vocab_size(self) -> int:
        """Size of the head's output distribution: draft_vocab_size, or the target's vocabulary."""
        return self.args.vocab_size if self.draft_vocab is None else int(self.draft_vocab.numel())

    def set_draft_vocab(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Set the draft vocabulary: `draft_vocab_size` distinct target token ids (stored ascending)."""
        if self.draft_vocab is None:
            raise ValueError("this head drafts over the full vocabulary (draft_vocab_size = 0)")
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().unique()  # sorted
        n = self.draft_vocab.numel()
        if ids.numel() != n:
            raise ValueError(f"draft vocabulary needs {n} distinct token ids, got {ids.numel()}")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.args.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.args.vocab_size})")
        with torch.no_grad():
            self.draft_vocab.copy_(ids.to(self.draft_vocab.device))

    def lm_head_weight(self) -> torch.Tensor:
        """(Vd, H) frozen output projection of the head: the target lm_head, or its draft-vocabulary rows."""
        w = self.require_frozen().lm_head
        dv = self.draft_vocab
        if dv is None:
            return w
        key = (w.data_ptr(), dv.data_ptr(), dv._version, w.device, w.dtype)
        if self._lm_head_rows is None or self._lm_head_rows[0] != key:
            self._lm_head_rows = (key, w.index_select(0, dv.to(w.device)).contiguous())
        return self._lm_head_rows[1]

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the head's logits (any shape) → target token ids."""
        return idx if self.draft_vocab is None else self.draft_vocab.to(idx.device)[idx]

    def compute_logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """head_hidden: (N, H) head outputs → (N, Vd) through `draft_lm_head` (Vd = vocab_size), after `logit_input`.

        Column c is target token `to_target_ids(c)`.
        """
        w = self.draft_lm_head()
        # CPU fast paths serve draft steps' few rows (over the rows' copy under `stream_weights`)
        return linear(self.logit_input(head_hidden).to(w.dtype), w, w16=self.lm_rows_copy(w))

    def stream_weights(self, kind: str | None) -> int:
        """Inference on CPU: let the head's few-row products stream compact copies of its weights (`kind`: "bf16",
        half the bytes, or "int8", a quarter: `linear.weight_copy`), or its own weights again (None). The target
        verifies every drafted token, so the rounding may change a draft, never what is accepted. Returns how many
        linears stream a copy (the lm_head rows' copy is made at first use). Copies are kept when switched off:
        switching back to the same kind is free."""
        self._stream = kind
        return stream_linears(self, kind)

    def lm_rows_copy(self, w: torch.Tensor) -> torch.Tensor | None:
        """The copy of lm_head rows `w` (Vd, H) of the kind `stream_weights` set (made once per weight), else
        None."""
        if (self._stream is None or w.dtype != torch.float32 or not on_cpu(w.device)
                or (torch.is_grad_enabled() and w.requires_grad)):
            return None
        key = (w.data_ptr(), tensor_version(w), self._stream)
        if self._lm_w16 is None or self._lm_w16[0] != key:  # one row set per head drafts (as `_lm_head_rows`)
            self._lm_w16 = (key, weight_copy(w, self._stream))
        return self._lm_w16[1]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) → cos, sin (T, 1, D), from float32 frequencies kept per device."""
        rot = self._rotary.get(positions.device)
        if rot is None:
            rot = self._rotary[positions.device] = RotaryEmbedding(self.args.rope, device=positions.device)
        return family_of(self.args).rope(rot, positions, dtype)  # e.g. DeepSeek: one float32 angle per pair

    def attention_backend(self, device: torch.device) -> AttentionBackend | MLABackend:
        """The inference backend for `device` (created on first use: flashinfer plans need the device)."""
        attn = self._attn.get(device)
        if attn is None:
            attn = self._attn[device] = self._make_attention(self.backend_name, device, self.dtype)
        return attn

    def _make_attention(self, name: str, device: torch.device,
                        dtype: torch.dtype | None) -> AttentionBackend | MLABackend:
        """The backend `name` for the head's block, as the target's family makes it (MLA for a DeepSeek block)."""
        return family_of(self.args).attention(self.args, name, device, dtype)

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor | None = None, *, from_target: bool,
                logits_indices: torch.Tensor | None = None) -> HeadOutput:
        """Inference: one engine step over the head's paged KV pool.

        Args:
            hidden: (T, `input_width`) the target's features of the step's rows (h_i, or an aux head's aux layers)
                when `from_target` (a prefill, a catch-up), else (T, H) the head's own output (a chained draft step).
            token_ids: (T,) the token after each row, t_{i+1}.
            meta: the step's metadata (the rows' positions i, and the same page ids as the target).
            kv_cache: the head's one-layer pool (num_pages, 2, page_size, Hkv, D), or (num_pages, page_size, C + R)
                latent rows for a DeepSeek block (see `kv_shape`), or None for a cache-free prefill.
            from_target: which of the two inputs `hidden` is (the caller knows; see `features`).
            logits_indices: (N,) rows whose logits are wanted.
        Returns (hidden (T, H), logits (N, V) or None).
        """
        if hidden.shape[0] != token_ids.shape[0]:
            raise ValueError(f"{hidden.shape[0]} hidden rows but {token_ids.shape[0]} tokens")
        self.check_input(hidden, from_target)
        attn = self.attention_backend(hidden.device)
        attn.prepare(meta)
        fused = self.native_step(hidden, token_ids, meta, kv_cache, attn, from_target, logits_indices)
        if fused is not None:
            return fused
        out = self.features(hidden, token_ids, meta, kv_cache, attn, from_target=from_target)
        logits = None if logits_indices is None else self.compute_logits(out[logits_indices])
        return HeadOutput(out, logits)

    def native_step(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                    kv_cache: torch.Tensor | None, attn: AttentionBackend | MLABackend, from_target: bool,
                    logits_indices: torch.Tensor | None) -> HeadOutput | None:
        """`forward`'s whole step in one native call where the head type has one and every part of it would take
        its native kernel anyway (a CPU draft or catch-up step of a few rows), else None: `forward` then runs it
        op by op. Arguments as `forward`'s, after `attn.prepare(meta)`."""
        return None

    def forward_train(self, hidden: torch.Tensor, next_tokens: torch.Tensor,
                      seq_lens: Sequence[int] | torch.Tensor | None = None, *,
                      cu_seqlens: Sequence[int] | torch.Tensor | None = None,
                      from_target: bool = True) -> torch.Tensor:
        """Training: a packed batch of whole sequences, causal attention within each, no KV cache.

        hidden: (T, `input_width`) the target's features (or, with from_target=False, (T, H) the head's own output);
        next_tokens: (T,) t_{i+1} per row (see `packed_shift`); seq_lens: (B,) or cu_seqlens: (B+1,). Positions
        restart at 0 in every sequence. Returns (T, H), differentiable.
        """
        if hidden.shape[0] != next_tokens.shape[0]:
            raise ValueError(f"{hidden.shape[0]} hidden rows but {next_tokens.shape[0]} tokens")
        self.check_input(hidden, from_target)
        lens = resolve_seq_lens(hidden.shape[0], seq_lens, cu_seqlens)
        meta = AttentionMetadata.build(lens, device=hidden.device)
        self._train_attn.prepare(meta)
        return self.features(hidden, next_tokens, meta, None, self._train_attn, from_target=from_target)

    def probe_features(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The head's output features over the rows of one sequence without a cache, (T, `input_width`) and (T,)
        → (T, ·): what an export's round trip compares (`export.exporter.verify_round_trip`); a chain head's
        inference prefill."""
        return self(hidden, token_ids, AttentionMetadata.build([hidden.shape[0]], device=hidden.device),
                    from_target=True).hidden

    def loss_rows(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  seq_lens: Sequence[int] | torch.Tensor, seed: int | None = None) -> torch.Tensor | None:
        """(T,) bool, the only rows `unroll` predicts and the loss counts (a block drafter's anchors), or None: every
        row; or (T,) integer, row i counted at the steps j < rows[i] only (P-EAGLE's COD sampling: fewer rows at
        deeper steps; `heads.packing.step_rows` gives a step's). A head that returns rows gets them as
        `unroll(..., rows=...)`; they must depend on the batch and `seed` alone (the trainer counts them before the
        loss, `train.losses.step_token_counts`, and every sequence-parallel rank draws them for the whole batch).
        seed: the training step's draw (`train.losses.step_anchor_seed`), or None (evaluation: a draw fixed by the
        batch)."""
        return None

    def step_extra_loss(self, pred: torch.Tensor, target: torch.Tensor,
                        counted: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """A loss term of the head's own for one step, beside the token and feature losses (dspark's confidence
        head), or None. pred: (T, ·) the step's prediction; target: (T, H) the target's hidden of the predicted
        position; counted: (T,) bool. Returns (a sum over the counted rows, metrics sums); the loss normalises both."""
        return None

    @abstractmethod
    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
               steps: int, attention: str = "chain", chain_mode: str = "diagonal") -> list[torch.Tensor]:
        """The head type's training unroll: `steps` predictions per row of a packed batch.

        Args:
            hidden: (T, `input_width`) the target's features h_i (or an aux head's aux layers).
            input_ids: (T,) the sequences' own tokens t_i (not shifted).
            seq_lens: (B,) the packed sequences' lengths.
            steps: how many predictions per row (`loss.steps`).
            attention, chain_mode: how a chain head's later steps attend (`loss.unroll_attention`, the chained
                attention's mode); a head that does not chain may ignore them.
        Returns one (T, H) tensor per step: row i of step j estimates h_{i+j+1}, whatever the head computes it from
        (a chain of forwards, or one forward for a whole block); the loss scores every head type the same way.

        Two keyword-only arguments are passed only when in use, so a head type that takes neither still trains
        without them (and is refused by name when they are set: `accepts_unroll_option`): `shard`
        (`heads.sequence.SequenceShard`, train.sequence_parallel: hidden and the returned tensors are this rank's
        rows of the padded batch that input_ids and seq_lens describe whole) and `checkpoint`
        (train.activation_checkpointing: recompute each step's forward in the backward).
        """

    @classmethod
    def accepts_unroll_option(cls, name: str) -> bool:
        """Whether this head type's `unroll` takes the keyword `name` (`shard`, `checkpoint`)."""
        return name in inspect.signature(cls.unroll).parameters

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"type={c.type}, enorm={c.enorm}, hnorm={c.hnorm}, input_norm={c.input_norm}, "
                f"final_norm={c.final_norm}, fc_bias={c.fc_bias}, features={c.features}, aux_layers={self.aux_layers}, "
                f"aux_norm={c.aux_norm}, draft_vocab={self.vocab_size}"
                + "".join(f", {k}={v}" for k, v in vars(c.settings).items()))


class ChainHead(DraftHead):
    """A head that drafts one token per forward, each step reading the previous step's output (mtp, eagle1, eagle3):
    its training unroll is that chain (alignment and attention modes in the module docstring)."""

    def __init__(self, cfg: HeadConfig, target_args: ModelArgs, frozen: FrozenTargetParts | None = None,
                 backend: str = "torch") -> None:
        super().__init__(cfg, target_args, frozen, backend)
        self._head_plans = cpu_kernels.LayerPlans()  # the step as `native_step` runs it, per set of weights
        self._step_memo: PlanMemo | None = None  # native_step's plans by (rows, logits rows), while nothing moved

    def target_fc(self) -> Linear | None:
        """The projection a step from the target takes first, (T, `input_width`) → (T, H) (an aux head's fc), or None
        where the target's rows enter the step as they are."""
        return None

    def _native_head_plan(self, hidden: torch.Tensor, attn: AttentionBackend | MLABackend,
                          kv_cache: torch.Tensor, meta: AttentionMetadata,
                          n: int) -> tuple[cpu_kernels.HeadPlan, bool, bool] | tuple[()]:
        """`native_step`'s plan for hidden's rows (m, H) and n logits rows (the head's `HeadPlan`, and whether the
        gemv's AVX-512 body runs the m and the n rows), or () where the step runs op by op (the default)."""
        return ()

    def _head_plan(self, plan: cpu_kernels.LayerPlan, norms: Sequence[nn.Module | None], eps: float,
                   fc: Linear | None, m: int, n: int,
                   raw_out: bool = False) -> tuple[cpu_kernels.HeadPlan, bool, bool] | tuple[()]:
        """What every type's `_native_head_plan` ends with: the `HeadPlan` over its layer's `plan` (kept per set of
        weights), or () where a part has no native form here.

        Args:
            plan: the head's layer (`LayerPlan`).
            norms: the embedding's, the features' and the final norm (None = absent), each an RMSNorm of `eps`, the
                layer's.
            eps: the layer's eps, the one the call uses.
            fc: the fc over [embedding ; features] in the call, or None (EAGLE-3).
            m, n: the step's rows and logits rows.
            raw_out: `HeadPlan`'s (EAGLE-3's pre-norm features).
        """
        embed, lm = self.require_frozen().embed, self.draft_lm_head()
        fc_w = None if fc is None else gemv_weight(fc, m)
        lm_w = gemv_operand(n, lm, self.lm_rows_copy(lm)) if n else lm
        if ((fc is not None and fc_w is None) or lm_w is None or embed.dtype != torch.float32
                or not embed.is_contiguous() or not on_cpu(embed.device)
                or any(x is not None and (type(x) is not RMSNorm or x.eps != eps) for x in norms)):
            return ()
        key = (plan.address, None if fc_w is None else fc_w.data_ptr(), lm_w.data_ptr(), embed.data_ptr())
        hp = self._head_plans.get(key)
        if hp is None:
            en, hn, fn = (None if x is None else x.weight.detach().contiguous() for x in norms)
            bias = None if fc is None or fc.bias is None else fc.bias.detach().contiguous()
            hp = self._head_plans.add(key, cpu_kernels.HeadPlan(
                cpu_kernels.HeadWeights(embed.detach(), en, hn, fn, None if fc_w is None else fc_w.detach(), bias,
                                        lm_w.detach()), plan, eps, raw_out))
        return hp, gemv_avx512(m), gemv_avx512(n) if n else False

    def native_step(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                    kv_cache: torch.Tensor | None, attn: AttentionBackend | MLABackend, from_target: bool,
                    logits_indices: torch.Tensor | None) -> HeadOutput | None:
        """The features and the logits in one native call (`cpu_kernels.head_step`) where the head type makes a plan
        (`_native_head_plan`: its layer runs in one call on a CPU step's few rows, its products take the native
        gemv for these rows, its norms share the layer's eps). A step from the target through `target_fc` (an aux
        head's catch-up over the verify's rows) takes that fc first, as one few-row product, then the same call as
        a chained step. The same arithmetic as `features` + `compute_logits`, without their ~15 dispatches, each
        slowed by caches the weights flushed."""
        m, n = hidden.shape[0], 0 if logits_indices is None else logits_indices.shape[0]
        st = meta.backend_state
        # the step's own conditions of the layer's native_plan; the rest holds while the memo's key does
        if (kv_cache is None or not st.get("native") or st["native_args"].slots is None or hidden.dim() != 2
                or not hidden.is_contiguous() or not kv_cache.is_contiguous()
                or not cpu_kernels.serves(hidden, kv_cache)):
            return None
        fc = self.target_fc() if from_target else None
        # one plan serves both inputs: after the fc, the call reads (T, H) rows as a chained step does
        key = (cpu_kernels.generation(), streaming_generation(), torch.is_grad_enabled(), id(attn))
        memo = self._step_memo
        if memo is None or memo.key != key or not memo.valid():
            frozen = self.require_frozen()
            watched = [x.weight for x in self.modules() if isinstance(x, Linear) and x.w16 is not None]
            watched += [t for t in (frozen.lm_head, self.draft_vocab) if t is not None]  # the lm rows' sources
            memo = self._step_memo = PlanMemo(key, [*self.parameters(), frozen.embed, frozen.lm_head], watched)
        step = memo.plans.get((m, n))
        if step is None:  # the plan checks the layer's input rows: (m, H), what the fc gives
            rows_in = hidden.new_empty((m, self.args.hidden_size)) if fc is not None else hidden
            step = memo.plans[(m, n)] = self._native_head_plan(rows_in, attn, kv_cache, meta, n)
        if not step:
            return None
        hp, avx512_m, avx512_n = step
        if fc is not None:
            hidden = fc(self.aux_input(hidden)).contiguous()  # (m, k·H) → (m, H), as `features` does
        cos, sin = self.rope(meta.rotary_positions, torch.float32)
        rows = None if logits_indices is None else logits_indices.to(torch.int64).contiguous()
        out, logits = cpu_kernels.head_step(hp, hidden, token_ids.to(torch.int64).contiguous(), rows, cos, sin,
                                            kv_cache, st["native_args"], avx512_m, avx512_n)
        return HeadOutput(out, logits)

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
               steps: int, attention: str = "chain", chain_mode: str = "diagonal", *,
               shard: SequenceShard | None = None, checkpoint: bool = False) -> list[torch.Tensor]:
        """Chain `steps` training forwards (alignment and `attention` modes in the module docstring; `chain_mode`:
        how the chain attention computes it, `ChainTrainAttention`'s `mode`).

        hidden: (T, H) target hidden h_i, or (T, k·H) its aux layers (`input_width`); input_ids: (T,) the
        sequences' own tokens t_i (NOT shifted: step j shifts them j+1 to the left). Step j > 0 reads step j-1's
        output at the same row. Returns one (T, H) tensor per step; row i of step j estimates h_{i+j+1}.
        Gradients flow through the whole chain.

        shard: sequence parallelism (`heads/sequence.py`): hidden is then this rank's rows (T/N, ·) of the padded
        batch that input_ids and seq_lens describe whole; each step's per-row work runs on those rows at their
        global positions, its attention over the whole batch through the shard's Ulysses exchange, and the
        returned tensors are this rank's rows (T/N, H). checkpoint: each step's forward is recomputed in the
        backward instead of keeping its activations (`torch.utils.checkpoint`, non-reentrant).
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if attention not in UNROLL_ATTENTION:
            raise ValueError(f"unknown unroll attention {attention!r}; choose one of {', '.join(UNROLL_ATTENTION)}")
        self.check_input(hidden, True)
        lens = resolve_seq_lens(input_ids.shape[0], seq_lens)
        rows = input_ids.shape[0] if shard is None else shard.hi - shard.lo
        if hidden.shape[0] != rows:
            raise ValueError(f"{hidden.shape[0]} hidden rows for {rows} rows of the unroll")
        attn = self.unroll_attention(attention, chain_mode, shard)
        outs: list[torch.Tensor] = []
        x = hidden
        for j in range(steps):
            meta = AttentionMetadata.build(lens, device=hidden.device)
            meta.positions = meta.positions + j  # step j drafts at i + j; only the chain's mixed keys can tell
            tokens = packed_shift(input_ids, lens, j + 1)
            own = meta if shard is None else shard.local_meta(meta)  # this rank's rows at their global positions
            if shard is not None:
                tokens = shard.local(tokens)
            if checkpoint:
                x = torch_checkpoint(self._unroll_step, x, tokens, meta, own, attn, j, use_reentrant=False)
            else:
                x = self._unroll_step(x, tokens, meta, own, attn, j)
            outs.append(x)
        return outs

    def unroll_attention(self, attention: str, chain_mode: str,
                         shard: SequenceShard | None) -> AttentionBackend | MLABackend:
        """A fresh attention for one unroll: the chain's (`attention="chain"`) or the plain causal one; under a
        sequence shard, that attention over this rank's share of the heads inside the shard's Ulysses exchange."""
        if shard is None:
            return chain_attention(self.args, chain_mode) if attention == "chain" else self._train_attn
        args, repeat = ulysses_heads(self.args, shard.size)
        inner = (chain_attention(args, chain_mode) if attention == "chain"
                 else family_of(args).attention(args, "torch", torch.device("cpu"), None))
        return shard.wrap(inner, repeat)

    def _unroll_step(self, x: torch.Tensor, tokens: torch.Tensor, meta: AttentionMetadata, own: AttentionMetadata,
                     attn: AttentionBackend | MLABackend, step: int) -> torch.Tensor:
        """Step `step` of `unroll`: x (R, ·) the step's input rows, tokens (R,) their next tokens, meta the whole
        batch's metadata (the attention's), own the rows' (their positions) → (R, H).

        Re-entered in the backward when checkpointed: `begin_step` lets a chain attention drop the keys a first
        run of this step kept, and `prepare` restores the step's metadata (a later step prepared its own)."""
        begin = getattr(attn, "begin_step", None)  # the chain's attention keeps keys per step; causal has none
        if begin is not None:
            begin(step)
        attn.prepare(meta)
        # step 0 reads the target's features, every later step the previous step's output
        return self.features(x, tokens, own, None, attn, from_target=step == 0)
