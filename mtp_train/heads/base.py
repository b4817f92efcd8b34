"""The draft-head interface: its config, its two forward modes, the packed-batch alignment, and checkpoint I/O.

Notation: target hidden after the final norm `h_i` at position i, token `t_i`; the target's logits
`lm_head(h_i)` predict `t_{i+1}`. A head row at position i reads `h_i` and the embedding of `t_{i+1}` (the
token buffer is shifted one left against the hidden states) and predicts `h_{i+1}`, hence the
distribution of `t_{i+2}` through the frozen lm_head.

One module serves both modes:

* training: `forward_train` runs a packed batch of whole sequences with causal attention and no KV cache
  (the torch backend, so autograd works); `unroll` chains it for several draft steps;
* inference: `forward` runs any engine step (prefill, decode, verify) against the head's own one-layer
  paged KV pool, which uses the same page ids as the target.

Unrolled alignment (a sequence of n tokens, rows i = 0..n-1, steps j = 0..k-1):

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

The last j+1 rows of each sequence have no token t_{i+j+1}: they are fed token id 0 and never counted; no
counted row attends to them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from mtp_train.config.head import HeadConfig
from mtp_train.config.loss import UNROLL_ATTENTION
from mtp_train.fileio import atomic_write, atomic_write_text, sha256_file
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVLayout,
    LatentAsOneHead,
    MLABackend,
    make_attention_backend,
)
from mtp_train.layers.linear import linear
from mtp_train.layers.rotary import RotaryEmbedding
from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.models.loader import open_safetensors, resolve_dtype

log = logging.getLogger(__name__)

HEAD_FORMAT = "mtp_train.head"
HEAD_FORMAT_VERSION = 1
# Target dimensions a head checkpoint must agree with (vocab_size shows in no head tensor, so it is checked here).
DIM_KEYS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
            "qkv_bias", "o_bias", "mlp_bias", "qk_norm")

HEAD_TYPES: dict[str, type[DraftHead]] = {}


def register_head(cls: type[DraftHead]) -> type[DraftHead]:
    """Class decorator: make `cls` buildable from a HeadConfig whose type is `cls.type_name`."""
    HEAD_TYPES[cls.type_name] = cls
    return cls


class HeadOutput(NamedTuple):
    """What the inference forward returns (T = rows of the step, N = requested logit rows)."""

    hidden: torch.Tensor  # (T, H) the head's output feature: the estimate of h_{i+1}, fed to the next draft step
    logits: torch.Tensor | None  # (N, V) at the requested rows, else None


# --- packed-batch alignment -------------------------------------------------------------------------------------


def _lens_list(seq_lens: Sequence[int] | torch.Tensor) -> list[int]:
    return [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]


def resolve_seq_lens(num_rows: int, seq_lens: Sequence[int] | torch.Tensor | None = None,
                     cu_seqlens: Sequence[int] | torch.Tensor | None = None) -> list[int]:
    """Sequence lengths from either `seq_lens` (B,) or `cu_seqlens` (B+1,) offsets; they must cover `num_rows`."""
    if (seq_lens is None) == (cu_seqlens is None):
        raise ValueError("give exactly one of seq_lens and cu_seqlens")
    if seq_lens is None:
        cu = _lens_list(cu_seqlens)
        if not cu or cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[:3]}...")
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    else:
        lens = _lens_list(seq_lens)
    if sum(lens) != num_rows:
        raise ValueError(f"sequence lengths sum to {sum(lens)} but the packed batch has {num_rows} rows")
    return lens


def packed_valid(seq_lens: Sequence[int] | torch.Tensor, shift: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """(T,) bool: row i has a row i + shift in its own sequence (i.e. its index within the sequence < n - shift)."""
    lens = torch.as_tensor(_lens_list(seq_lens), dtype=torch.long, device=device)
    starts = torch.cumsum(lens, 0) - lens
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)
    within = torch.arange(int(lens.sum()), device=device) - starts[seq]
    return within + shift < lens[seq]


def packed_shift(x: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor, shift: int,
                 fill: float | int = 0) -> torch.Tensor:
    """Shift a packed (T, ...) buffer `shift` rows to the left inside each sequence.

    out[i] = x[i + shift] when row i + shift belongs to the same sequence as row i, else `fill`
    (e.g. tokens t_{i+1} against hidden states h_i for shift 1). Differentiable in x.
    """
    valid = packed_valid(seq_lens, shift, x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    src = torch.where(valid, rows + shift, rows)
    out = x[src]
    mask = valid.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, out, torch.full_like(out, fill))


class ChainTrainAttention(AttentionBackend):
    """Training attention of an unrolled chain, one instance per `unroll` call (EAGLE-3's training-time test).

    Call j (step j) of the instance keeps that step's keys/values (T, Hkv, D); row i of step j attends to the
    step-0 keys of rows 0..i of its sequence and to its own keys of steps 1..j, one each. That is what draft
    step j at position i+j attends to at inference, when the head's KV cache holds the entries computed from
    the target's hidden states up to position i and the chain's own entries after it. Step 0 is the plain
    causal prefill. The caller gives step j the positions i + j (keys carry RoPE at their own positions).
    """

    name = "chain-train"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, sliding_window)
        self.keys: list[torch.Tensor] = []  # per step (T, Hkv, D)
        self.values: list[torch.Tensor] = []

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to plan: masks depend on the step, built in `forward`."""

    def _mask(self, q_pos: torch.Tensor, step: int) -> torch.Tensor | None:
        """q_pos: (n,) positions i + step of one sequence's queries → bool (n, (step+1)·n), True = attend."""
        n = q_pos.shape[0]
        rows = torch.arange(n, device=q_pos.device)
        if step == 0 and self.sliding_window is None:
            return None  # plain causal
        base = q_pos - step  # the chain's start positions i
        parts = [rows[None, :] <= rows[:, None]] + [torch.eye(n, dtype=torch.bool, device=q_pos.device)] * step
        mask = torch.cat(parts, 1)
        if self.sliding_window is not None:
            k_pos = torch.cat([base + s for s in range(step + 1)])  # ((step+1)·n,)
            mask &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
        return mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D) of this step → (T, Hq, D); no KV cache."""
        if kv_cache is not None:
            raise ValueError("training attention takes no KV cache")
        self.keys.append(k)
        self.values.append(v)
        step = len(self.keys) - 1
        outs = []
        for b, n in enumerate(meta.qo_lens):
            lo = int(meta.qo_indptr[b])
            sl = slice(lo, lo + n)
            keys = torch.cat([x[sl] for x in self.keys], 0)  # ((step+1)·n, Hkv, D)
            values = torch.cat([x[sl] for x in self.values], 0)
            mask = self._mask(meta.positions[sl], step)
            out = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=self.num_q_heads != self.num_kv_heads,
            )  # (1, Hq, n, D)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs, 0)


# --- the interface ----------------------------------------------------------------------------------------------


class DraftHead(nn.Module, ABC):
    """A draft head over a frozen target: trainable layers here, frozen embedding and lm_head in `self.frozen`.

    `self.frozen` is a plain attribute, not a registered submodule or buffer, so `parameters()`,
    `state_dict()`, `.to()` and any training engine see only the head's own weights.
    """

    type_name: ClassVar[str] = "base"
    num_kv_layers: ClassVar[int] = 1  # layers in the head's own paged KV pool

    def __init__(self, cfg: HeadConfig, target_args: ModelArgs, frozen: FrozenTargetParts | None = None,
                 backend: str = "torch") -> None:
        super().__init__()
        if cfg.type != self.type_name:
            raise ValueError(f"{type(self).__name__} needs a HeadConfig of type {self.type_name!r}, got {cfg.type!r}")
        if target_args.model_type == "deepseek_v2" and cfg.type != "mtp":
            raise ModelConfigError(f"{cfg.type} heads take Llama-family targets; a DeepSeek-V2 target takes an mtp "
                                   "head (its block is DeepSeek's: MLA + a dense MLP, or MoE with head.moe=true)")
        self.cfg = cfg.resolved()
        self.target_args = target_args
        self.args = dataclasses.replace(target_args, num_layers=1)  # the head's decoder: target shapes, one layer
        self.frozen = frozen
        self.backend_name = backend
        a = self.args
        # Training always uses the torch backend (SDPA supports autograd); inference uses `backend`, per device.
        self._train_attn = self._make_attention("torch", torch.device("cpu"), None)
        self._attn: dict[torch.device, AttentionBackend | MLABackend] = {}
        # RoPE frequencies outside the module tree: an engine that casts the module to bf16 must not round them.
        self._rotary: dict[torch.device, RotaryEmbedding] = {}
        n = self.cfg.draft_vocab_size
        if n > a.vocab_size:
            raise ValueError(f"draft_vocab_size {n} exceeds the target's vocabulary ({a.vocab_size})")
        self.draft_vocab: torch.Tensor | None
        if 0 < n < a.vocab_size:
            # Target token ids of the draft vocabulary, ascending; set from data with `set_draft_vocab`.
            self.register_buffer("draft_vocab", torch.arange(n, dtype=torch.long))
        else:
            self.draft_vocab = None
        self._lm_head_rows: tuple[tuple[int, int, int, torch.device, torch.dtype], torch.Tensor] | None = None

    # -- what a head type implements --

    @abstractmethod
    def features(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: torch.Tensor | None, attn: AttentionBackend | MLABackend) -> torch.Tensor:
        """The head's output feature for every row.

        hidden: (T, H) input features (h_i, or the previous step's output); token_ids: (T,) the token that
        follows each row (t_{i+1}); meta: the step's metadata, already prepared for `attn` (an MLABackend for a
        DeepSeek block); kv_cache: the head's one-layer pool (num_pages, 2, page_size, Hkv, D), or (num_pages,
        page_size, C + R) latent rows for a DeepSeek block, written at the step's slots, or None.
        Returns (T, H): the estimate of h_{i+1}.
        """

    def init_from_target(self, target_dir: str | Path) -> None:
        """Copy target weights into the head (HeadConfig.init = last_layer); heads without such init refuse."""
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
        """head_hidden: (N, H) → (N, Vd) through the frozen lm_head rows of the draft vocabulary (Vd = vocab_size).

        Column c is target token `to_target_ids(c)`.
        """
        w = self.lm_head_weight()
        return linear(head_hidden.to(w.dtype), w)  # the CPU fast paths serve draft steps' few rows

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) → cos, sin (T, 1, D), from float32 frequencies kept per device."""
        rot = self._rotary.get(positions.device)
        if rot is None:
            rot = self._rotary[positions.device] = RotaryEmbedding(self.args.rope, device=positions.device)
        if self.args.model_type == "deepseek_v2":  # pairwise rotation: one angle per pair, in float32
            from mtp_train.models.deepseek_v2 import pair_angles

            return pair_angles(rot, positions)
        return rot(positions, dtype)

    def attention_backend(self, device: torch.device) -> AttentionBackend | MLABackend:
        """The inference backend for `device` (created on first use: flashinfer plans need the device)."""
        attn = self._attn.get(device)
        if attn is None:
            attn = self._attn[device] = self._make_attention(self.backend_name, device, self.dtype)
        return attn

    def _make_attention(self, name: str, device: torch.device,
                        dtype: torch.dtype | None) -> AttentionBackend | MLABackend:
        """The backend `name` for the head's block: generic attention, or MLA for a DeepSeek block."""
        a = self.args
        if a.kv_layout.latent:
            from mtp_train.models.deepseek_v2 import make_mla_attention

            return make_mla_attention(a, name, device, dtype)
        return make_attention_backend(name, a.num_heads, a.num_kv_heads, a.head_dim, a.sliding_window, device=device)

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor | None = None, *, logits_indices: torch.Tensor | None = None) -> HeadOutput:
        """Inference: one engine step over the head's paged KV pool.

        hidden: (T, H) target hidden states h_i of the step's rows (or the head's own output for chained
        draft steps); token_ids: (T,) the token after each row, t_{i+1}; meta: the step's metadata (the
        rows' positions i, and the same page ids as the target); kv_cache: the head's one-layer pool
        (num_pages, 2, page_size, Hkv, D), or (num_pages, page_size, C + R) latent rows for a DeepSeek block (see
        `kv_shape`), or None for a cache-free prefill; logits_indices: (N,) rows whose
        logits are wanted. Returns (hidden (T, H), logits (N, V) or None).
        """
        if hidden.shape[0] != token_ids.shape[0]:
            raise ValueError(f"{hidden.shape[0]} hidden rows but {token_ids.shape[0]} tokens")
        attn = self.attention_backend(hidden.device)
        attn.prepare(meta)
        out = self.features(hidden, token_ids, meta, kv_cache, attn)
        logits = None if logits_indices is None else self.compute_logits(out[logits_indices])
        return HeadOutput(out, logits)

    def forward_train(self, hidden: torch.Tensor, next_tokens: torch.Tensor,
                      seq_lens: Sequence[int] | torch.Tensor | None = None, *,
                      cu_seqlens: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Training: a packed batch of whole sequences, causal attention within each, no KV cache.

        hidden: (T, H) input features; next_tokens: (T,) t_{i+1} per row (see `packed_shift`); seq_lens: (B,)
        or cu_seqlens: (B+1,). Positions restart at 0 in every sequence. Returns (T, H), differentiable.
        """
        if hidden.shape[0] != next_tokens.shape[0]:
            raise ValueError(f"{hidden.shape[0]} hidden rows but {next_tokens.shape[0]} tokens")
        lens = resolve_seq_lens(hidden.shape[0], seq_lens, cu_seqlens)
        meta = AttentionMetadata.build(lens, device=hidden.device)
        self._train_attn.prepare(meta)
        return self.features(hidden, next_tokens, meta, None, self._train_attn)

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
               steps: int, attention: str = "chain") -> list[torch.Tensor]:
        """Chain `steps` training forwards (alignment and `attention` modes in the module docstring).

        hidden: (T, H) target hidden h_i; input_ids: (T,) the sequences' own tokens t_i (NOT shifted: step j
        shifts them j+1 to the left). Step j > 0 reads step j-1's output at the same row. Returns one (T, H)
        tensor per step; row i of step j estimates h_{i+j+1}. Gradients flow through the whole chain.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if attention not in UNROLL_ATTENTION:
            raise ValueError(f"unknown unroll attention {attention!r}; choose one of {', '.join(UNROLL_ATTENTION)}")
        lens = resolve_seq_lens(hidden.shape[0], seq_lens)
        a = self.args
        attn: AttentionBackend | MLABackend = self._train_attn
        if attention == "chain":
            chain = ChainTrainAttention(a.num_heads, a.num_kv_heads, a.head_dim, a.sliding_window)
            if a.kv_layout.latent:  # MLA: the latent row is the chain's one KV head, scaled as the expanded head
                chain.scale = a.softmax_scale
                attn = LatentAsOneHead(chain, a.kv_lora_rank)
            else:
                attn = chain
        outs: list[torch.Tensor] = []
        x = hidden
        for j in range(steps):
            meta = AttentionMetadata.build(lens, device=hidden.device)
            meta.positions = meta.positions + j  # step j drafts at i + j; only the chain's mixed keys can tell
            attn.prepare(meta)
            x = self.features(x, packed_shift(input_ids, lens, j + 1), meta, None, attn)
            outs.append(x)
        return outs

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"type={c.type}, enorm={c.enorm}, hnorm={c.hnorm}, input_norm={c.input_norm}, "
                f"final_norm={c.final_norm}, fc_bias={c.fc_bias}, draft_vocab={self.vocab_size}")


# --- building, saving, loading ----------------------------------------------------------------------------------


def head_dims(args: ModelArgs) -> dict[str, Any]:
    """The target dimensions a head depends on, as recorded in a head's config.json."""
    return {k: getattr(args, k) for k in DIM_KEYS}


def build_head(cfg: HeadConfig, target_dir: str | Path, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "auto", backend: str = "torch",
               frozen: FrozenTargetParts | None = None) -> DraftHead:
    """A new head for the target in `target_dir`, with its frozen embedding / lm_head read from there.

    dtype: auto (the target's) | float32 | bfloat16 | float16, for the head and the frozen parts alike.
    `cfg.init = last_layer` copies the target's last decoder layer into the head's layer.
    """
    if cfg.type not in HEAD_TYPES:
        raise ValueError(f"head type {cfg.type!r} has no implementation; known: {', '.join(HEAD_TYPES)}")
    if frozen is None:
        frozen = FrozenTargetParts.from_pretrained(target_dir, device=device, dtype=dtype)
    head = HEAD_TYPES[cfg.type](cfg, frozen.args, frozen, backend)
    if head.cfg.init == "last_layer":
        head.init_from_target(target_dir)
    dt = resolve_dtype(dtype, frozen.args)
    return head.to(device=device, dtype=dt)


def file_checksums(folder: str | Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{name: {"sha256", "bytes"}} of files in `folder`, the record `verify_files` checks."""
    folder = Path(folder)
    return {n: {"sha256": sha256_file(folder / n), "bytes": (folder / n).stat().st_size} for n in names}


def verify_files(folder: str | Path, files: dict[str, Any] | None, config: str | Path) -> bool:
    """Check files of `folder` against the `files` record of its config (`config`, named in errors).

    Raises ModelConfigError naming the first file that is missing or differs; returns False (after a warning)
    when there is no record (a folder written before checksums were recorded), True when everything matched.
    """
    folder = Path(folder)
    if not files:
        log.warning("%s records no checksums (written by an older version): %s is not verified", config, folder)
        return False
    todo = "the file is damaged or was changed; copy or export the head again from the run's heads/step-N"
    for name, want in sorted(files.items()):
        path = folder / name
        try:
            sha, size = str(want["sha256"]), int(want["bytes"])
        except (KeyError, TypeError, ValueError):
            raise ModelConfigError(f"{config}: malformed checksum entry for {name!r}") from None
        if not path.is_file():
            raise ModelConfigError(f"{path} is missing (its checksum is in {config}); {todo}")
        if path.stat().st_size != size:
            raise ModelConfigError(f"{path} has {path.stat().st_size} bytes, {config} records {size}: {todo}")
        if sha256_file(path) != sha:
            raise ModelConfigError(f"{path} does not match the sha256 recorded in {config}: {todo}")
    return True


def save_head(head: DraftHead, out_dir: str | Path, extra_config: dict[str, Any] | None = None, *,
              target_fingerprint: str | None = None) -> Path:
    """Write `model.safetensors` (the head's trainable weights only) and `config.json` into `out_dir`.

    config.json records the format, the head config (norms resolved), the target dims, the target's weight
    fingerprint when given (`load_head` then refuses other weights), the parameter count, the dtype, the sha256
    and size of model.safetensors under "files" (`load_head` checks them), and `extra_config` under "extra"
    (e.g. training step, data manifest). Files are written to a temporary name and renamed, so a crash never
    leaves a half-written head.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    atomic_write(out / "model.safetensors", lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    config = {
        "format": HEAD_FORMAT,
        "format_version": HEAD_FORMAT_VERSION,
        "head": head.cfg.to_dict(),
        "dims": head_dims(head.target_args),
        "target_model_type": head.target_args.model_type,
        "target_fingerprint": target_fingerprint,
        "num_params": head.num_params(),
        "dtype": str(head.dtype).replace("torch.", ""),
        "files": file_checksums(out, ["model.safetensors"]),
        "extra": extra_config or {},
    }
    atomic_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def read_json_config(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, with a ModelConfigError naming the file (line, column) when it is not one."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; the file is "
                               "damaged: copy or export the head again") from None
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{path}: not UTF-8 ({e.reason} at byte {e.start}); the file is damaged: copy or "
                               "export the head again") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


def read_head_config(head_dir: str | Path) -> dict[str, Any]:
    """The config.json of a head folder, checked to be one of ours."""
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path} is missing: {head_dir} is not a head checkpoint (see save_head)")
    cfg = read_json_config(path)
    if cfg.get("format") != HEAD_FORMAT:
        raise ModelConfigError(f"{path}: format {cfg.get('format')!r} is not {HEAD_FORMAT!r}")
    if cfg.get("format_version") != HEAD_FORMAT_VERSION:
        raise ModelConfigError(f"{path}: format_version {cfg.get('format_version')} is not {HEAD_FORMAT_VERSION}")
    bad = [k for k in ("head", "dims") if not isinstance(cfg.get(k), dict)]
    if bad:
        raise ModelConfigError(f"{path}: {', '.join(bad)} missing or not an object; the file is damaged: copy or "
                               "export the head again")
    return cfg


def load_head(head_dir: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
              dtype: str | torch.dtype | None = None, backend: str = "torch", *,
              verify_fingerprint: bool = True) -> DraftHead:
    """Load a head saved by `save_head` for the target in `target_dir` (frozen parts read from there).

    Refuses, naming the file, a model.safetensors whose sha256 is not the one config.json records; then, naming
    every offending key with both values: target dims that differ from the recorded ones, and tensors whose
    shapes differ from what the target implies. When the head recorded a target
    fingerprint (and verify_fingerprint), the target's weights must have that fingerprint. dtype None keeps
    the checkpoint's dtype.
    """
    head_dir, target_dir = Path(head_dir), Path(target_dir)
    cfg_json = read_head_config(head_dir)
    verify_files(head_dir, cfg_json.get("files"), head_dir / "config.json")  # before a byte of it is read
    args = ModelArgs.from_dir(target_dir)

    problems = [f"dims.{k}: head checkpoint {cfg_json['dims'].get(k)!r}, target {v!r}"
                for k, v in head_dims(args).items() if cfg_json["dims"].get(k) != v]
    try:
        head_cfg = HeadConfig(**cfg_json["head"])  # `init` is history here: the weights come from the file
    except TypeError as e:
        raise ModelConfigError(f"{head_dir / 'config.json'}: head {e}") from None
    if head_cfg.type not in HEAD_TYPES:
        raise ModelConfigError(f"{head_dir}: head type {head_cfg.type!r} has no implementation")
    with torch.device("meta"):
        head = HEAD_TYPES[head_cfg.type](head_cfg, args, None, backend)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    weights = head_dir / "model.safetensors"
    with open_safetensors(weights) as f:
        names = set(f.keys())  # noqa: SIM118 (safe_open is not a dict)
        for k in sorted(names & expected.keys()):
            shape = tuple(f.get_slice(k).get_shape())
            if shape != expected[k]:
                problems.append(f"{k}: head checkpoint {shape}, target implies {expected[k]}")
        problems += [f"{k}: missing from the head checkpoint" for k in sorted(expected.keys() - names)]
        problems += [f"{k}: not a tensor of a {head_cfg.type} head" for k in sorted(names - expected.keys())]
        if problems:
            raise ModelConfigError(f"head {head_dir} does not fit target {target_dir}:\n  " + "\n  ".join(problems))
        state = {k: f.get_tensor(k) for k in names}

    recorded = cfg_json.get("target_fingerprint")
    if recorded and verify_fingerprint:
        actual = weights_fingerprint(target_dir, full="-full:" in recorded)
        if actual != recorded:
            raise ModelConfigError(f"head {head_dir} was trained for target weights {recorded}, but {target_dir} "
                                   f"has {actual}; pass the right target (or verify_fingerprint=False)")

    dt = resolve_dtype(dtype, args) if dtype is not None else next(v for v in state.values()
                                                                   if v.is_floating_point()).dtype
    # Integer buffers (the draft vocabulary) keep their dtype.
    head.load_state_dict({k: v.to(device=device, dtype=dt if v.is_floating_point() else v.dtype)
                          for k, v in state.items()}, assign=True)
    head.attach(FrozenTargetParts.from_pretrained(target_dir, device=device, dtype=dt))
    return head.eval()
