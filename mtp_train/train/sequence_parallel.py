"""Sequence parallelism of training (`train.sequence_parallel=N`): the run's groups, each batch's shard, the Ulysses
exchange of the chain heads' attention, and the refusals made before any work.

The ranks [g·N, (g+1)·N) form group g (`dist.sequence_groups`); a group reads the batches of data-parallel rank g
(the sources are built with the data-parallel rank and world) and splits every batch's rows over its ranks
(`heads.sequence.SequenceShard`). What a head does with its rows is the head's (`heads/sequence.py`); this module
gives the chain heads their attention exchange, DeepSpeed's `DistributedAttention` (Ulysses: all-to-all from
(T/N rows, all heads) to (T rows, heads/N) and back), so that the heads never import deepspeed.

Gradients: every rank's loss is its rows' share of the global mean (`train.losses.unrolled_loss`), and DeepSpeed
averages gradients over all ranks with the trainer's loss · world, so the applied gradient is the sum of every
rank's, exactly the gradient of a run without sequence parallelism.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as tdist

from mtp_train.config import ConfigError, TrainConfig
from mtp_train.config.device import on_cpu
from mtp_train.dist import SequenceGroups, sequence_groups
from mtp_train.heads import ChainHead, head_class
from mtp_train.heads.sequence import SequenceShard, ulysses_heads
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata
from mtp_train.models.config import ModelConfigError
from mtp_train.models.foreign import head_target_args
from mtp_train.train.deepspeed_setup import skip_cpu_shm_comm_build
from mtp_train.train.losses import refuse_unroll_options


class UlyssesAttention(AttentionBackend):
    """The attention a chain head's layer calls with its own rows (T/N, Hq, D): DeepSpeed's `DistributedAttention`
    around `inner`, the whole-batch attention over this rank's Hq/N query heads (and its KV heads, each repeated
    `kv_repeat` times first where there are fewer KV heads than the split needs).

    `prepare` takes the whole batch's metadata, which `inner` reads; `forward` ignores the metadata the layer passes
    (its own rows'). `begin_step` reaches the chain attention inside (recomputed steps, `ChainHead.unroll`).
    """

    name = "ulysses"

    def __init__(self, inner: AttentionBackend, group: tdist.ProcessGroup, size: int, kv_repeat: int) -> None:
        from deepspeed.sequence.layer import DistributedAttention

        super().__init__(inner.num_q_heads * size, inner.num_kv_heads * size // kv_repeat, inner.head_dim,
                         inner.sliding_window)
        self.inner, self.kv_repeat = inner, kv_repeat
        self.meta: AttentionMetadata | None = None
        # scatter the heads (dim 2), gather the rows (dim 0) of (rows, 1, heads, D): the sequence-first layout
        self.exchange = DistributedAttention(self._attend_local, group, scatter_idx=2, gather_idx=0,
                                             num_kv_heads=inner.num_kv_heads * size)

    @property
    def tree_steps(self) -> bool:
        return False

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.inner.prepare(meta)

    def begin_step(self, step: int) -> None:
        begin = getattr(self.inner, "begin_step", None)  # the chain's attention; a causal one keeps nothing
        if begin is not None:
            begin(step)

    def _attend_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
                      meta: AttentionMetadata) -> torch.Tensor:
        """(T, 1, Hq/N, D), (T, 1, Hkv'/N, D) ×2 → (T, 1, Hq/N, Dv): the whole batch over this rank's heads."""
        return self.inner.forward(q[:, 0], k[:, 0], v[:, 0], kv_cache, meta)[:, None]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: (T/N, Hq, D); k, v: (T/N, Hkv, D) this rank's rows → (T/N, Hq, Dv)."""
        if self.meta is None:
            raise RuntimeError("UlyssesAttention.forward before prepare")
        if self.kv_repeat > 1:  # every query head keeps its own KV head: head h of Hkv·r is KV head h // r
            k, v = k.repeat_interleave(self.kv_repeat, 1), v.repeat_interleave(self.kv_repeat, 1)
        out = self.exchange(q[:, None], k[:, None], v[:, None], 1, None, kv_cache, self.meta)
        return out[:, 0]


@dataclasses.dataclass
class SequenceParallel:
    """The run's sequence parallelism: its groups, and the shard of each batch (None when N = 1)."""

    groups: SequenceGroups

    @classmethod
    def setup(cls, size: int, rank: int, world: int, device: torch.device) -> SequenceParallel:
        """Create the groups (every rank at once); with N > 1 also DeepSpeed's communication, which the attention
        exchange runs on (`deepspeed.initialize` would make it later; a sharded forward may come first)."""
        groups = sequence_groups(size, rank, world)
        if groups.size > 1:
            import deepspeed.comm

            if on_cpu(device):
                skip_cpu_shm_comm_build()
            if not deepspeed.comm.is_initialized():
                deepspeed.comm.init_distributed(dist_backend=tdist.get_backend(), auto_mpi_discovery=False,
                                                verbose=False)
        return cls(groups)

    @property
    def size(self) -> int:
        return self.groups.size

    def shard(self, num_rows: int) -> SequenceShard | None:
        """This rank's share of a batch of `num_rows` rows; None without sequence parallelism."""
        g = self.groups
        if g.size == 1:
            return None
        assert g.group is not None
        return SequenceShard.split(g.group, g.size, g.index, num_rows, self._wrap)

    def _wrap(self, inner: AttentionBackend, kv_repeat: int) -> AttentionBackend:
        assert self.groups.group is not None
        return UlyssesAttention(inner, self.groups.group, self.groups.size, kv_repeat)


def check_sequence_parallel(cfg: TrainConfig, world: int) -> None:
    """Refuse, before any work, a `train.sequence_parallel` the job cannot run: one that does not divide the world,
    a head type whose unroll takes no shard (or no checkpointing, for train.activation_checkpointing), and a chain
    head whose attention heads cannot be split (`heads.sequence.ulysses_heads`: head counts, DeepSeek MLA)."""
    t = cfg.train
    cls = head_class(cfg.head.type)
    if t.activation_checkpointing:
        refuse_unroll_options(cls, ["checkpoint"])
    n = t.sequence_parallel
    if n == 1:
        return
    if world % n:
        raise ConfigError(f"train.sequence_parallel={n} does not divide the world size {world}: give a divisor of "
                          f"{world}, or launch a multiple of {n} ranks (torchrun --nproc_per_node)")
    refuse_unroll_options(cls, ["shard"])
    if issubclass(cls, ChainHead):
        args = dataclasses.replace(head_target_args(Path(cfg.model.path)), num_layers=1)
        try:
            ulysses_heads(args, n)
        except ModelConfigError as exc:
            raise ConfigError(str(exc)) from None
