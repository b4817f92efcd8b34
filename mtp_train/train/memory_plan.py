"""The training memory plan: the predicted peak memory of one rank of `mtp-train`, term by term.

A pure function of the settings and the target's config.json (no weights are read; nothing is allocated). The
peak is what is alive at once in the step that peaks: every lasting term below, plus the largest of the transient
ones (the token loss's vocabulary chunk while every step's activations are kept, or a block drafter's attention
backward while they still are).

    runtime        the process before any tensor: a CUDA context and the kernels' workspace (CUDA), or this
                   process's own resident set after torch and deepspeed are imported (CPU: measured, passed in)
    frozen         the target's embedding and lm_head the trainer holds (one matrix when tied): bf16 on CUDA, fp32
                   on the CPU
    batch          the stored states of one micro-batch (final hidden and aux layers, as stored): every
                   sequence-parallel rank holds the batch whole; on the CPU the shard pages read stay mapped too
    weights        the head's parameters in the compute dtype, plus DeepSpeed's fp32 master copy (its partition
                   under ZeRO 1/2)
    gradients      ZeRO-2: the rank's fp32 partition plus the reduction bucket (CUDA: `reduce_bucket_size`
                   elements, allocated whole; CPU: the pages written); ZeRO 0/1: whole
    optimizer      AdamW's two fp32 moments, partitioned over the data-parallel ranks under ZeRO 1/2
    activations    per token and unrolled step, the tensors autograd keeps for the head's layer(s) and the loss's
                   per-row tensors, over the rank's share of the tokens (divided by train.sequence_parallel);
                   train.activation_checkpointing keeps only each step's inputs and recomputes one step at a time
    loss chunk     `loss.chunk_size` rows × the (draft) vocabulary of fp32 logits, the copies the token loss holds
                   (transient: in the forward and the loss's backward)
    attention grad a block drafter's attention backward: the context K/V's gradient and one chunk of anchors'
                   explicit group (transient: in the layer's backward; the peak counts the larger of the two)
    exchange       a chain head under sequence parallelism: what Ulysses adds on a rank, per row of its share
                   ~`ULYSSES_VALUES` H-wide values once (one step's all-to-all copies of q, k, v and the output, or
                   their gradients: transient, one step at a time); measured on the CPU, not counted
    online target  data.source=online|hybrid: the target's weights / model.tp and its prefill over one micro-batch

The coefficients of the activation and loss terms are counts of the tensors the code keeps (the functions'
docstrings below), checked against measured peaks of real runs on the CPU (`python -m bench.train_memory`,
tests/test_memory_plan.py); the CUDA side (bf16 values, the runtime, the whole bucket) is counted, not measured.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mtp_train.config import HeadConfig, TrainConfig
from mtp_train.config.errors import ConfigError
from mtp_train.fileio import human_bytes
from mtp_train.heads import head_class
from mtp_train.heads.block_attention import SCORE_BUDGET
from mtp_train.models.config import ModelArgs

GIB = 2**30
FP32, BF16 = 4, 2
# CUDA: the context, cuBLAS / cuDNN workspaces and the caching allocator's slack beyond the tensors (an estimate, not
# a measurement of this code)
CUDA_RUNTIME_BYTES = int(1.5 * GIB)
# The token loss's (rows, V) fp32 tensors alive at its peak, per `loss.ce_impl`: checkpoint holds the head's and
# the target's logits, the target's softmax, their product, the head's softmax inside α and the recomputation's
# pair in the backward; fused (the default) holds the logits, the target's and the gradient written into one of
# them. Measured on the CPU (bench.train_memory) and rounded up.
LOSS_CHUNK_COPIES = {"checkpoint": 6.0, "fused": 3.0}
# H-wide values per row of its share a chain head's rank adds under sequence parallelism, once (one unrolled step's
# Ulysses copies at a time): measured peaks of eagle3 at SP 2, 4k-32k tokens, grow per local row as at SP 1 (the
# earlier 14 per row and step fitted peaks that held freed blocks, bench.train_memory's docstring)
ULYSSES_VALUES = 2
# The backward's own temporaries of a layer beyond what the forward kept: the gradients of its widest products
# (the MLP's gate / up and their activation), alive while the saved tensors still are.
BACKWARD_WIDTHS = 2  # × the MLP's intermediate size
# A block drafter's attention backward: the sequence's context K/V gradient (sink row and columns included) in
# copies of Hkv × (n + 1) × (D + e): for K and V each the running sum over the chunks, a chunk's SDPA gradient of
# its prefix, that prefix's gradient as the whole context's (autograd's slice backward), and at the end the packed
# context's own gradient (the backward's peak RSS on the CPU, SmolLM2's head shape, 16 anchors of 16: 7.3-8.0
# copies at 64k-128k context rows); and one chunk's explicit group in float32 (its recomputed scores and
# probabilities, and their gradients), in units of `heads.block_attention.SCORE_BUDGET` scores.
CONTEXT_GRAD_COPIES = 8
EXPLICIT_GROUP_COPIES = 4


@dataclass(frozen=True)
class Term:
    """One term of the plan: its name, bytes per rank, and how it was counted (shown beside it). A transient term
    exists at one moment of the step only (the loss's chunk in the forward, a gradient in the backward): the peak
    counts the largest of them, beside every other term."""

    name: str
    bytes: int
    how: str
    transient: bool = False


@dataclass
class PlanSettings:
    """What the plan depends on besides the target's shapes.

    Args:
        head: the head's settings, resolved against the target (`HeadConfig.resolved`).
        steps: unrolled steps (`loss.steps`).
        chunk_size: rows of logits at a time (`loss.chunk_size`).
        ce_impl: the token loss's implementation (`loss.ce_impl`).
        w_feat: the feature loss's weight (its per-row tensors exist only when > 0).
        length: tokens of the longest sample.
        micro_batch_tokens: the micro-batch's token budget (`train.micro_batch_tokens`).
        sequence_parallel: ranks sharing one sample's positions (`train.sequence_parallel`).
        activation_checkpointing: recompute each step's forward in the backward.
        world: ranks of the job.
        zero_stage: DeepSpeed's `zero_optimization.stage` (0, 1, 2).
        reduce_bucket_size: DeepSpeed's gradient bucket in elements (ZeRO 1/2 with contiguous_gradients).
        device: "cuda" or "cpu" (dtype and runtime differ).
        runtime: bytes of the process before any tensor (see the module docstring).
        storage_bytes: bytes per stored hidden value (2 for bf16 folders).
        online: the trainer holds the target (data.source online / hybrid).
        optimizer: `train.optimizer`; muon keeps one fp32 momentum per 2-D matrix, AdamW's two moments on the rest
            (the head's own vocabulary-indexed lm_head among them).
        tp: the online target's tensor-parallel ranks (`model.tp`).
    """

    head: HeadConfig
    steps: int
    chunk_size: int
    ce_impl: str
    w_feat: float
    length: int
    micro_batch_tokens: int
    sequence_parallel: int
    activation_checkpointing: bool
    world: int
    zero_stage: int
    reduce_bucket_size: int
    device: str
    runtime: int
    storage_bytes: int = BF16
    online: bool = False
    optimizer: str = "adamw"  # train.optimizer: adamw (two moments) | muon (one momentum per matrix)
    tp: int = 1


@dataclass
class MemoryPlan:
    """The predicted peak of one rank (`total`): its terms and what it was planned for."""

    terms: list[Term]
    settings: PlanSettings
    head_params: int
    tokens: int = 0  # tokens of one micro-batch
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """The peak: every lasting term, plus the largest transient one."""
        return (sum(t.bytes for t in self.terms if not t.transient)
                + max((t.bytes for t in self.terms if t.transient), default=0))

    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)

    def lines(self) -> Iterator[str]:
        """The plan as text: one line per term, then the peak per rank."""
        s = self.settings
        yield (f"memory plan per rank: head {s.head.type} ({self.head_params / 1e6:.1f}M parameters), {s.device}, "
               f"{self.tokens} tokens per micro-batch (longest sample {s.length}), loss.steps={s.steps}, "
               f"world {s.world}, ZeRO-{s.zero_stage}, sequence_parallel={s.sequence_parallel}, "
               f"activation_checkpointing={str(s.activation_checkpointing).lower()}")
        for t in self.terms:
            yield f"  {t.name:<15}{t.bytes / GIB:9.3f} GiB  {'(transient) ' if t.transient else ''}{t.how}"
        if sum(t.transient for t in self.terms) > 1:
            yield "  (the transient terms exist at different moments of a step: the peak counts the largest)"
        for note in self.notes:
            yield f"  ({note})"
        yield f"peak per rank {self.total / GIB:.3f} GiB ({self.total} bytes)"


# --- the head's shapes -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadShape:
    """What the plan reads off the head's module, built on the meta device (exact, nothing allocated).

    params: trainable parameters; qkv_in: the width its layer's q/k/v read (H, or 2H for EAGLE-3's layer);
    own_lm_head: values of a trainable lm_head of its own (its gradient builds up in the loss's backward), 0 when it
    reads the target's frozen one; layers: its draft decoder layers; frozen: parameters of its own that never train
    (an EAGLE-3 draft lm_head kept at the target's rows, `head.train_lm_head=false`): weights only.
    """

    params: int
    qkv_in: int
    own_lm_head: int
    layers: int
    frozen: int = 0


def head_shape(head: HeadConfig, args: ModelArgs) -> HeadShape:
    """The head's `HeadShape` on a target of shapes `args`."""
    with torch.device("meta"):
        module = head_class(head.type)(head, args, None)
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    qkv = [m.in_features for n, m in module.named_modules() if n.endswith("qkv_proj") and hasattr(m, "in_features")]
    lm = getattr(module, "lm_head", None)
    own = sum(p.numel() for p in lm.parameters() if p.requires_grad) if isinstance(lm, torch.nn.Module) else 0
    layers = len(module.layers) if isinstance(getattr(module, "layers", None), torch.nn.ModuleList) else 1
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return HeadShape(params, qkv[0] if qkv else args.hidden_size, own, layers, frozen)


def draft_vocab(head: HeadConfig, args: ModelArgs) -> int:
    """The vocabulary the loss's logits span: the draft vocabulary when set, else the target's."""
    return min(head.draft_vocab_size, args.vocab_size) if head.draft_vocab_size > 0 else args.vocab_size


def layer_values(args: ModelArgs, qkv_in: int) -> int:
    """Values per row a Llama-family decoder layer keeps for its backward: its input and input norm, q/k/v and
    the rotated q/k, the attention's output (a fused kernel keeps q, k, v, out and a logsumexp), o_proj's output,
    the residual and the post-attention norm, gate/up, the activation and the product, the MLP's output. qkv_in:
    the width q/k/v read (H, or 2H for EAGLE-3's layer)."""
    h, inter = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return qkv_in + h + (q + 2 * kv) + (q + kv) + q + 4 * h + 4 * inter


def backward_values(args: ModelArgs) -> int:
    """Values per row of the backward's own temporaries (`BACKWARD_WIDTHS` × the intermediate size): one layer's
    backward runs at a time, so they are counted once, not per unrolled step or draft layer."""
    return BACKWARD_WIDTHS * args.intermediate_size


def chain_around_values(args: ModelArgs) -> int:
    """Values per row and step around a chain head's layer: the embedding and its norm, the features and their
    norm, their concatenation (2H, the fc's or the attention's input), the final norm."""
    return 7 * args.hidden_size


def loss_values(args: ModelArgs, w_feat: float) -> int:
    """Values per row and step the loss keeps outside the logits: the step's shifted targets, the counted rows
    gathered (prediction and target), and the feature loss's elementwise terms when it is on."""
    h = args.hidden_size
    return 3 * h + (2 * h if w_feat > 0 else 0)


def block_rows(head: HeadConfig, tokens: int) -> int:
    """Rows a block drafter's draft layers run: max_anchors blocks of block_size rows (fewer on a short batch)."""
    return min(head.settings.max_anchors, tokens) * head.settings.block_size


# --- the plan --------------------------------------------------------------------------------------------------


def plan_memory(s: PlanSettings, args: ModelArgs) -> MemoryPlan:
    """The predicted peak memory of one rank training head `s.head` on a target of shapes `args`.

    Args:
        s: the settings (`PlanSettings`; `plan_settings` builds them from a TrainConfig).
        args: the target's shapes (its config.json, `models.foreign.head_target_args`).
    Returns the plan (terms in bytes).
    """
    cuda = s.device == "cuda"
    act = BF16 if cuda else FP32  # the engine's compute dtype: bf16 on CUDA, fp32 on the CPU
    h, vocab = args.hidden_size, args.vocab_size
    head = s.head
    k = len(head.aux_layers) if head.features == "aux" else 0
    shape = head_shape(head, args)
    params = shape.params
    tokens = max(s.length, s.micro_batch_tokens)  # a packed micro-batch: its budget, or one longer sample
    sp = max(1, s.sequence_parallel)
    share = -(-tokens // sp)  # rows of this rank
    dp = max(1, s.world)  # ZeRO partitions over every rank (sequence-parallel ranks hold the same gradients)
    terms = [Term("runtime", s.runtime, "CUDA context and workspaces" if cuda else
                  "this process after torch and deepspeed are imported (measured)")]

    tied = bool(args.tie_word_embeddings)
    frozen = (1 if tied else 2) * vocab * h * act
    terms.append(Term("frozen", frozen, f"embedding{'' if tied else ' + lm_head'} {vocab} × {h}, "
                                        f"{'bf16' if cuda else 'fp32'}"))

    stored = tokens * (1 + k) * h * s.storage_bytes
    copies = 1 if cuda else 2  # CPU: the shard's mapped pages and the batch's copy
    terms.append(Term("batch", copies * stored + tokens * 16,
                      f"{tokens} tokens × (1 + {k}) × {h} stored values, whole on every SP rank"
                      + ("" if cuda else "; mapped pages + the batch")))

    master = params * FP32 // (dp if s.zero_stage >= 1 else 1)
    weights = (params + shape.frozen) * act + (master if s.zero_stage >= 1 or cuda else 0)
    terms.append(Term("weights", weights, f"{params / 1e6:.1f}M × {act} B"
                      + (f" + fp32 master / {dp if s.zero_stage >= 1 else 1}" if s.zero_stage >= 1 or cuda else "")
                      + (f" + {shape.frozen / 1e6:.1f}M frozen × {act} B" if shape.frozen else "")))

    if s.zero_stage >= 2:
        bucket = s.reduce_bucket_size * act if cuda else min(s.reduce_bucket_size, params) * act
        grads = params * FP32 // dp + bucket
        how = f"fp32 partition / {dp} + bucket of " + (f"{s.reduce_bucket_size} elements" if cuda else "the gradients")
    else:
        bucket = (s.reduce_bucket_size * FP32 if cuda else 0) if s.zero_stage == 1 else 0
        grads = params * act + (params * FP32 // dp if s.zero_stage == 1 else 0) + bucket
        how = "whole" + (f" + fp32 partition / {dp} + bucket" if s.zero_stage == 1 else "")
    terms.append(Term("gradients", grads, how))
    if s.optimizer == "muon":  # ZeRO 0 only (refused otherwise): Muon's momentum on the matrices, AdamW on the rest
        adam = shape.own_lm_head
        terms.append(Term("optimizer", ((params - adam) + 2 * adam) * FP32,
                          f"Muon momentum, 1 × fp32 on {(params - adam) / 1e6:.1f}M"
                          + (f" + AdamW moments, 2 × fp32 on the own lm_head's {adam / 1e6:.1f}M" if adam else "")))
    else:
        terms.append(Term("optimizer", 2 * params * FP32 // (dp if s.zero_stage >= 1 else 1),
                          f"AdamW moments, 2 × fp32{f' / {dp}' if s.zero_stage >= 1 else ''}"))

    terms.append(activation_term(s, args, shape, share, tokens, act))
    rows = loss_rows(s, share, tokens)
    if head.spec.block:  # its token loss runs over every slot's rows at once (grouped by target position)
        rows *= s.steps
    v_loss = draft_vocab(head, args)
    chunk = min(s.chunk_size, max(rows, 1))
    copies_l = LOSS_CHUNK_COPIES.get(s.ce_impl, LOSS_CHUNK_COPIES["checkpoint"])
    # a trainable lm_head of the head's own: its gradient builds up over the chunks, beside one chunk's share
    own = 2 * shape.own_lm_head * FP32
    terms.append(Term("loss chunk", int(copies_l * chunk * v_loss * FP32) + own,
                      f"{copies_l:g} × {chunk} rows × {v_loss} vocabulary, fp32 ({s.ce_impl})"
                      + (f" + the own lm_head's gradient, 2 × {shape.own_lm_head / 1e6:.1f}M fp32" if own else ""),
                      transient=True))
    if head.spec.block:
        terms.append(block_attention_grad_term(s, args, tokens, act, cuda))
    elif sp > 1:
        terms.append(Term("exchange", ULYSSES_VALUES * share * h * act,
                          f"Ulysses: ~{ULYSSES_VALUES} × {h} values per row of {share} rows, one step at a time "
                          "(measured)"))

    if s.online:
        terms.append(online_term(args, tokens, s.tp, act))
    plan = MemoryPlan(terms, s, params, tokens)
    if sp > 1:
        plan.notes.append(f"each of the {sp} sequence-parallel ranks runs {share} of the {tokens} rows")
    return plan


def loss_rows(s: PlanSettings, share: int, tokens: int) -> int:
    """Rows one step's loss scores on this rank: its share of the tokens, or a block drafter's anchors in it."""
    if s.head.spec.block:
        return -(-min(s.head.settings.max_anchors, tokens) // max(1, s.sequence_parallel))
    return share


def activation_term(s: PlanSettings, args: ModelArgs, shape: HeadShape, share: int, tokens: int,
                    act: int) -> Term:
    """The activations of one micro-batch on this rank.

    A chain head: per row and step its layer (`layer_values`), what surrounds it (`chain_around_values`) and the
    loss's rows (`loss_values`), plus an aux head's (T, k·H) step-0 input; checkpointed, each step's output, its
    K/V (later steps attend to them) and the loss's rows stay, and one step's layer at a time is recomputed. A block
    drafter: its draft layers over max_anchors × block_size rows, the context (fc over the aux layers, its norm,
    each draft layer's context K/V) over every row, and per drafted slot a (T, H) output and the loss's rows;
    checkpointed, one draft layer's activations at a time (the others keep their input).

    Args:
        s: the plan's settings.
        args: the target's shapes.
        shape: the head's (`head_shape`).
        share: this rank's rows (tokens / train.sequence_parallel).
        tokens: the micro-batch's tokens.
        act: bytes per value of the compute dtype.
    """
    head, h = s.head, args.hidden_size
    k = len(head.aux_layers) if head.features == "aux" else 0
    sp = max(1, s.sequence_parallel)
    kv = args.num_kv_heads * args.head_dim
    if head.spec.block:
        # a rank drafts the blocks of the anchors in its rows
        anchors = -(-min(head.settings.max_anchors, tokens) // sp)
        rows = anchors * head.settings.block_size
        per_layer = rows * layer_values(args, shape.qkv_in)
        backward = rows * backward_values(args)
        # the context over this rank's rows: fc over the aux layers, its norm, each layer's K/V; under SP every
        # rank also holds all ranks' context K/V, gathered (a block reads its sequence's context before its anchor)
        context = share * (k * h + 2 * h + shape.layers * 2 * kv) + (tokens * shape.layers * 2 * kv if sp > 1 else 0)
        outs = s.steps * share * (h + loss_values(args, s.w_feat))
        kept = (per_layer + (shape.layers - 1) * rows * h if s.activation_checkpointing
                else shape.layers * per_layer)
        kept += context + outs + backward
        how = (f"{shape.layers} draft layer(s) × {rows} rows ({anchors} anchors × {head.settings.block_size}), context "
               f"{share} rows, {s.steps} slots")
    else:
        layer = layer_values(args, shape.qkv_in) + chain_around_values(args)
        loss = loss_values(args, s.w_feat)
        step0 = share * k * h  # an aux head's step 0 reads (T, k·H) through its fc
        backward = share * backward_values(args)
        if s.activation_checkpointing:
            kept = share * (s.steps * (h + 2 * kv + loss) + layer) + step0 + backward
        else:
            kept = share * s.steps * (layer + loss) + step0 + backward
        how = f"{share} rows × ({s.steps} step(s) × {layer + loss} + {backward_values(args)} backward) values"
    if s.activation_checkpointing:
        how += ", checkpointed"
    return Term("activations", kept * act, how + f", {'bf16' if act == BF16 else 'fp32'}")


def block_attention_grad_term(s: PlanSettings, args: ModelArgs, tokens: int, act: int, cuda: bool) -> Term:
    """A block drafter's attention backward (`heads.block_attention`): the gradient of the sequence's context K/V
    (with its sink row and columns), `CONTEXT_GRAD_COPIES` × Hkv × (n + 1) × (D + sink columns) (every chunk's SDPA
    reads one view of them; no copy per anchor), and one chunk of anchors' explicit group recomputed in float32
    (its probabilities and their gradients, `SCORE_BUDGET` scores each). Neither grows with the anchors.
    n: the longest sequence's context (the longest sample)."""
    n = min(s.length, tokens)
    width = args.head_dim + (8 if cuda else 2)  # `block_attention.sink_columns`: 8 on CUDA, 2 elsewhere
    kv_grad = CONTEXT_GRAD_COPIES * args.num_kv_heads * (n + 1) * width * act
    group = EXPLICIT_GROUP_COPIES * SCORE_BUDGET * FP32
    return Term("attention grad", kv_grad + group,
                f"the context K/V gradient, {CONTEXT_GRAD_COPIES} × {args.num_kv_heads} KV heads × {n + 1} keys × "
                f"{width}, + one chunk's explicit group, {EXPLICIT_GROUP_COPIES} × {SCORE_BUDGET} fp32 scores",
                transient=True)


def online_term(args: ModelArgs, tokens: int, tp: int, act: int) -> Term:
    """The target held for data.source=online|hybrid: its weights / tp in the compute dtype (counted on the meta
    device) and the temporaries of a cache-free prefill over one micro-batch (the widest layer's: hidden, q/k/v,
    the MLP's, or an MoE layer's active and shared experts', 3 × its width / tp; and the hidden it returns)."""
    from mtp_train.models.loader import model_class

    with torch.device("meta"):
        params = sum(p.numel() for p in model_class(args)(args).parameters())
    h = args.hidden_size
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    active = getattr(args, "num_experts_per_tok", 0) + getattr(args, "n_shared_experts", 0)
    inter = max(args.intermediate_size, getattr(args, "moe_intermediate_size", 0) * active)
    prefill = tokens * (4 * h + qkv // tp + 3 * inter // tp) * act + tokens * h * act
    return Term("online target", params * act // tp + prefill,
                f"{params / 1e9:.2f}B parameters / tp {tp} + prefill of {tokens} tokens")


# --- from the run's settings -----------------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    """A /proc/self/status size field (VmRSS, VmHWM) in bytes, 0 where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def process_rss() -> int:
    """This process's resident set in bytes (VmRSS), 0 where /proc does not say."""
    return _status_bytes("VmRSS")


def peak_bytes(device: torch.device) -> int:
    """What this rank has used at most so far, the measured counterpart of the plan's peak: on CUDA the caching
    allocator's peak reservation plus what the device holds outside it now (the context, cuBLAS workspaces: the
    plan's runtime term; exact with one process per GPU); on the CPU the process's peak resident set (VmHWM)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside = max(0, total - free - torch.cuda.memory_reserved(device))
        return int(torch.cuda.max_memory_reserved(device)) + outside
    return _status_bytes("VmHWM")


def runtime_bytes(device: str) -> int:
    """The runtime term: `CUDA_RUNTIME_BYTES` on CUDA; on the CPU this process's resident set once torch and
    deepspeed are imported (a training process has imported both before its first tensor)."""
    if device == "cuda":
        return CUDA_RUNTIME_BYTES
    import deepspeed  # noqa: F401  (what a training process holds before its first tensor)

    return process_rss()


def longest_sample(folder: str | Path) -> int | None:
    """The longest sample of a finished precompute folder, from its shards' offsets (None when unreadable: a damaged
    folder is the data source's to refuse, by name, once the run reads it)."""
    from safetensors import SafetensorError, safe_open

    from mtp_train.precompute.manifest import Manifest, ManifestError

    try:
        manifest = Manifest.load(folder)
        longest = 0
        for shard in manifest.shards:
            with safe_open(str(Path(folder) / shard.file), "np") as f:
                offsets = f.get_tensor("offsets")
            if offsets.size > 1:
                longest = max(longest, int(np.diff(offsets).max()))
        return longest or None
    except (ManifestError, OSError, KeyError, ValueError, SafetensorError):
        return None


def sample_length(tc: TrainConfig) -> tuple[int, str]:
    """The sample length to plan for and where it came from: `plan_length`, the data's longest sample (a readable
    precompute folder), the cut of samples made from conversations (data.online.max_seq_len: online, fleet, a
    hybrid run's first epoch), else train.micro_batch_tokens."""
    if tc.plan_length > 0:
        return tc.plan_length, "plan_length"
    if tc.data.source in ("offline", "hybrid"):  # hybrid: the folder its epoch 0 wrote, once there
        found = longest_sample(tc.data.dir)
        if found is not None:
            return found, f"the longest sample of {tc.data.dir}"
    if tc.data.source != "offline":  # samples made from conversations are cut at max_seq_len
        return tc.data.online.max_seq_len, "data.online.max_seq_len"
    return tc.train.micro_batch_tokens, "train.micro_batch_tokens (the data is not readable)"


def plan_settings(tc: TrainConfig, args: ModelArgs, device: str, world: int, length: int,
                  runtime: int) -> PlanSettings:
    """The plan's settings from a run's config.

    Args:
        tc: the run's settings.
        args: the target's shapes.
        device: "cuda" or "cpu".
        world: ranks of the job.
        length: tokens of the longest sample (`sample_length`).
        runtime: the runtime term in bytes (`runtime_bytes`).
    """
    zero = dict(tc.deepspeed.zero_optimization)
    stage = int(zero.get("stage", 0))
    bucket = int(float(zero.get("reduce_bucket_size", 500_000_000))) if zero.get("contiguous_gradients", True) else 0
    storage = 1 if tc.data.online.hidden_dtype == "float8_e4m3" else BF16
    return PlanSettings(
        head=tc.head.resolved(args.num_layers), steps=tc.loss.steps, chunk_size=tc.loss.chunk_size,
        ce_impl=tc.loss.ce_impl, w_feat=tc.loss.w_feat, length=length, micro_batch_tokens=tc.train.micro_batch_tokens,
        sequence_parallel=int(getattr(tc.train, "sequence_parallel", 1)),
        activation_checkpointing=bool(getattr(tc.train, "activation_checkpointing", False)), world=world,
        zero_stage=stage, reduce_bucket_size=bucket, device=device, runtime=runtime, storage_bytes=storage,
        online=tc.data.source in ("online", "hybrid"), tp=max(1, tc.model.tp),
        optimizer=str(getattr(tc.train, "optimizer", "adamw")))


# --- the check -------------------------------------------------------------------------------------------------

ADVICE = {
    "activations": "raise train.sequence_parallel, set train.activation_checkpointing=true or lower "
                   "train.micro_batch_tokens",
    "loss chunk": "lower loss.chunk_size",
    "batch": "lower train.micro_batch_tokens (or raise train.sequence_parallel only for the activations: every SP "
             "rank holds the batch whole)",
    "optimizer": "use ZeRO-2 (deepspeed=zero2) over more ranks",
    "gradients": "use ZeRO-2 over more ranks, or lower deepspeed.zero_optimization.reduce_bucket_size",
    "weights": "use ZeRO-1/2 over more ranks",
    "online target": "raise model.tp or precompute the hidden states (data.source=offline)",
    "attention grad": "lower train.micro_batch_tokens",
    "frozen": "use a device with more memory",
    "runtime": "use a device with more memory",
}


def device_memory(device: str) -> tuple[int | None, str]:
    """Bytes one rank may use on `device` and what they are: a GPU's total memory, or for the CPU the memory
    available to this process (MemAvailable plus this process's own resident set, capped by its cgroup's limit)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return None, "no CUDA device here"
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory), "the GPU's total"
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024 + process_rss()
    except (OSError, ValueError):
        pass
    limit = cgroup_limit()
    if limit is not None and (available is None or limit < available):
        return limit, "the cgroup's memory limit"
    return available, "MemAvailable + this process"


def cgroup_limit() -> int | None:
    """This process's cgroup memory limit in bytes (v2 memory.max, or v1's limit), None when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def check_plan(plan: MemoryPlan, limit: int, what: str) -> None:
    """Refuse a plan over `limit` bytes: one message naming the peak, the largest term and the setting to change."""
    if plan.total <= limit:
        return
    big = plan.largest()
    raise ConfigError(
        f"the memory plan of this run needs {human_bytes(plan.total)} per rank, over the {human_bytes(limit)} it may "
        f"use ({what}); the largest term is {big.name} ({human_bytes(big.bytes)}: {big.how}): "
        f"{ADVICE.get(big.name, 'use a device with more memory')}. `mtp-train ... plan=true` prints every term; "
        f"memory_limit_gib=N sets the limit, memory_check=false runs anyway")


def planned_world(tc: TrainConfig, launch_world: int) -> int:
    """The world size to plan for: plan_world, or the launch's."""
    return tc.plan_world if tc.plan_world > 0 else launch_world
