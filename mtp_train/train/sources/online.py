"""`data.source=online`: the target inside training, computing each micro-batch's hidden states.

`OnlineTarget` runs the frozen target's cache-free packed prefill (`engine.prefill_hidden`, what `mtp-precompute`
runs) over a micro-batch's samples right before the head's step and hands the head exactly what a precompute
folder would have given it: the final-norm hidden state and the head's aux layers, rounded through the storage
dtype (`precompute.as_stored`).

`OnlineSource` batches the conversations of `data.paths`, made into samples by stage one's own code
(`mtp_train.data.samples`) with `data.online.*` as its settings. The samples, their split and order are those of a
one-rank `mtp-precompute` with the same settings, so the batches (and the resume position) are exactly those of
an offline run on its folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from mtp_train.config import DATA_SOURCES, ConfigError, ModelConfig, TrainConfig
from mtp_train.config.device import on_cuda
from mtp_train.data.samples import Row, TokenDataset, load_rows
from mtp_train.dist import DistInfo
from mtp_train.engine.runner import prefill_hidden
from mtp_train.models.base import CausalLM
from mtp_train.models.families import args_from_dir
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.models.loader import load_model
from mtp_train.models.tensor_parallel import TPGroup, load_model_tp, tp_groups
from mtp_train.precompute import as_stored, check_settings, in_split
from mtp_train.train.data import MicroBatchStream, PackedBatch
from mtp_train.train.sources.base import DataSource, make_sampler, online_record, val_or_none

log = logging.getLogger(__name__)


def online_dtype(model_cfg: ModelConfig, device: torch.device) -> str:
    """The dtype the online target computes in: `model.dtype` when set, else bfloat16 on CUDA (as training's own
    compute) and the checkpoint's dtype elsewhere."""
    if model_cfg.dtype != "auto":
        return model_cfg.dtype
    return "bfloat16" if on_cuda(device) else "auto"


def token_lists(batch: PackedBatch) -> list[list[int]]:
    """A packed batch's samples as token lists (the input of a packed prefill)."""
    ids = batch.input_ids.tolist()
    out, a = [], 0
    for n in batch.seq_lens:
        out.append(ids[a:a + n])
        a += n
    return out


Forward = list[list[int]]  # the token lists of one packed prefill
Outputs = Callable[[int, torch.Tensor, torch.Tensor | None], None]  # (index, hidden (T, H), aux (T, k·H) | None)


class OnlineTarget:
    """The frozen target, loaded on first use, computing hidden states of packed token batches.

    aux_layers: the HF `hidden_states[j]` indices the head reads (concatenated into aux_hidden, in order);
    storage: the `hidden_dtype` whose rounding the head sees (`as_stored`). tp > 1: the target is split over
    groups of `tp` consecutive ranks (`models.tensor_parallel`), each rank holding 1/tp of its weights; every
    training rank still has its own batches, so a group runs its members' forwards one after another, each member
    computing all of them (the forward is collective) and keeping its own. Create it on every rank at once.
    """

    def __init__(self, model_cfg: ModelConfig, device: torch.device, aux_layers: Sequence[int], storage: str) -> None:
        self.path, self.device = Path(model_cfg.path), device
        self.dtype, self.backend = online_dtype(model_cfg, device), model_cfg.backend
        self.aux_layers, self.storage = [int(j) for j in aux_layers], storage
        # new_group is collective: every rank creates its OnlineTarget at the same point.
        self.tp: TPGroup | None = tp_groups(model_cfg.tp)[0] if model_cfg.tp > 1 else None
        self._model: CausalLM | None = None

    @property
    def model(self) -> CausalLM:
        if self._model is None:
            # No CPU pre-packing: it only speeds up 1-row decode products and doubles the weights' memory.
            if self.tp is not None:
                self._model = load_model_tp(self.path, self.tp, dtype=self.dtype, device=self.device,
                                            backend=self.backend, cpu_prepack=False)
            else:
                self._model = load_model(self.path, dtype=self.dtype, device=self.device, backend=self.backend,
                                         cpu_prepack=False)
        return self._model

    def release(self) -> None:
        """Drop the weights (hybrid, once epoch 0 is on disk); a later use loads them again."""
        self._model = None
        if on_cuda(self.device):
            torch.cuda.empty_cache()

    def _prefill(self, lists: Forward) -> tuple[torch.Tensor, torch.Tensor | None]:
        # no_grad, not inference_mode: the head's autograd graph takes these tensors as inputs.
        with torch.no_grad():
            out = prefill_hidden(self.model, lists, hidden_layers=self.aux_layers)
        aux = torch.cat([out.layers[j] for j in self.aux_layers], dim=-1) if self.aux_layers else None
        return out.hidden, aux

    def run(self, forwards: Sequence[Forward], fn: Outputs) -> None:
        """Run this rank's `forwards` in order, calling fn(i, hidden (T, H), aux (T, k·H) or None) for the i-th,
        in the target's compute dtype on its device. With tensor parallelism every member of the group calls this
        at the same time (with its own forwards, any number): they are gathered and run round by round."""
        if self.tp is None:
            for i, lists in enumerate(forwards):
                fn(i, *self._prefill(lists))
            return
        everyone: list[Any] = [None] * self.tp.size
        tdist.all_gather_object(everyone, list(forwards), group=self.tp.group)
        for i in range(max(len(f) for f in everyone)):
            for member, theirs in enumerate(everyone):
                if i < len(theirs):
                    hidden, aux = self._prefill(theirs[i])  # collective: every member runs every forward
                    if member == self.tp.rank:
                        fn(i, hidden, aux)

    def forward(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's (hidden (T, H), aux (T, k·H) or None) for one packed batch (on every TP member at once)."""
        got: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.run([token_lists(batch)], lambda _i, hidden, aux: got.append((hidden, aux)))
        return got[0]

    def stored(self, batch: PackedBatch, hidden: torch.Tensor, aux: torch.Tensor | None) -> PackedBatch:
        """`batch` with `forward`'s outputs as a precompute folder would give them (storage rounding)."""
        k = len(self.aux_layers)
        return PackedBatch(batch.input_ids, batch.loss_mask, as_stored(hidden, self.storage), batch.seq_lens,
                           batch.ids, None if aux is None else as_stored(aux, self.storage, groups=k), batch.epoch)


def split_rows(rows: Sequence[Row], split: str, cfg: TrainConfig) -> TokenDataset:
    """The rows of `split` ("train" | "val" | "all") by the rule a precompute folder records (`in_split`, with
    `data.online.seed` / `val_fraction`), in their order."""
    o = cfg.data.online
    return TokenDataset([r for r in rows if in_split(r.id, split, o.seed, o.val_fraction)], split)


@DATA_SOURCES.add
class OnlineSource(DataSource):
    """Batches of the conversations of `data.paths`, their hidden states computed by the target held here."""

    name = "online"
    plans_from_conversations = True
    runs_target = True

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        src = cfg.data.source
        if not str(cfg.model.path).strip():
            raise ConfigError(f"data.source={src} computes the target's hidden states during training: set "
                              "model.path to the target's Hugging Face folder (config.json + safetensors + tokenizer)")
        if not cfg.data.paths:
            raise ConfigError(f"data.source={src} reads conversations from data.paths, which is empty: give them "
                              "(data.paths=[convs.jsonl] or data=<conf/data name>), or train on a precompute folder "
                              "with data.source=offline data.dir=DIR")

    def __init__(self, cfg: TrainConfig, info: DistInfo, device: torch.device) -> None:
        from mtp_train.data import chat_template_fingerprint, tokenizer_fingerprint
        from mtp_train.data.chat import load_tokenizer

        c, src = cfg, cfg.data.source
        self.check_config(c)
        target_dir = Path(c.model.path)
        args = args_from_dir(target_dir)
        head = c.head.resolved(args.num_layers)  # the layers an aux head reads are the ones computed
        aux_layers = list(head.aux_layers) if head.features == "aux" else []
        self.settings = c.precompute_config(aux_layers)  # precompute's settings for these samples
        check_settings(self.settings, prefix="data.online.")
        tokenizer = load_tokenizer(target_dir)
        rows, self.data_info = load_rows(tokenizer, self.settings, args.vocab_size,
                                         context=args.max_position_embeddings, prefix="data.online.")
        o = c.data.online
        train_set = split_rows(rows, "train", c)
        if len(train_set) == 0:
            raise ValueError(f"data.source={src}: every sample of data.paths is in the val split; lower "
                             f"data.online.val_fraction (now {o.val_fraction})")
        val_set = split_rows(rows, "val", c) if c.train.eval_batches > 0 else None
        stream = MicroBatchStream(train_set, make_sampler(train_set.lengths, c, info.rank, info.world),
                                  num_workers=c.data.num_workers, pin_memory=on_cuda(device))
        super().__init__(c, train_set, val_or_none(val_set, "data.paths"), stream, weights_fingerprint(target_dir),
                         aux_layers, f"data.paths={list(c.data.paths)}")
        self.info, self.args, self.rows = info, args, rows
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        self.chat_template_fingerprint = chat_template_fingerprint(tokenizer)
        self.target = OnlineTarget(c.model, device, aux_layers, o.hidden_dtype)
        if info.is_main:
            log.info("data.source=%s: %d samples (%d train), %d tokens from %s; the target computes their hidden "
                     "states (%s, aux layers %s)", src, len(rows), len(train_set), sum(r.ids.size for r in rows),
                     list(c.data.paths), self.target.dtype, aux_layers)

    def record(self) -> dict[str, Any]:
        return {**super().record(), **online_record(self.cfg)}

    def fill(self, batch: PackedBatch) -> PackedBatch:
        return self.target.stored(batch, *self.target.forward(batch))
