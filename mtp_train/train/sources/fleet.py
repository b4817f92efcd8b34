"""`data.source=fleet`: training straight from running vLLM servers' captures, the spool's bytes bounded.

The samples, their split and the batch plan are online's (the conversations of `data.paths` made into samples by
stage one's code, `data.online.*`), so a fleet run takes the batches an offline run on a `backend=vllm`
precompute of the same conversations takes, in the same order. A batch's hidden states come from the capture
files that servers started with our connector (`capture.serve`) write into `data.fleet.spool_dir`: the driver
(`capture.fleet.FleetDriver`, a thread) asks for the captures in plan order, as far ahead as the spool's byte cap
allows, and `fill` waits for each of a batch's files, turns it into rows as `mtp-precompute backend=vllm` does
(`vllm_backend.rows_of`: the target's final norm over vLLM's last layer, then the storage rounding). Arrivals out
of order wait on disk until their batch comes, so the order never depends on the servers' timing.

A capture is named `<sample id>@epoch<e>` (each epoch asks again: the states are not kept) and deleted only once
a checkpoint covers it: the stream's state in the checkpoint carries a ledger of the epoch's consumed samples (a
bitmap over the train split and a count), the deletion waits for the checkpoint's `latest` marker. A resumed run
checks the ledger against the plan, deletes the files it covers and uses the captures of later samples already on
disk; so a trainer killed anywhere resumes with no sample lost or repeated, and a server killed mid-run costs only
its requests' retries (`remote.generator`). One training process (world 1): the servers are the parallel part.
"""

from __future__ import annotations

import base64
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mtp_train.capture.endpoints import EndpointCapture
from mtp_train.capture.fleet import FleetDriver, Wanted
from mtp_train.capture.layers import layer_map
from mtp_train.capture.spool import PREFIX, SUFFIX, capture_bound, read_capture, remove_torn
from mtp_train.config import DATA_SOURCES, ConfigError, TrainConfig
from mtp_train.config.precompute import VllmCaptureConfig
from mtp_train.data.chat import load_tokenizer
from mtp_train.data.samples import Row, load_rows
from mtp_train.dist import DistInfo
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.models.foreign import head_target_args
from mtp_train.models.loader import resolve_dtype
from mtp_train.precompute import as_stored, check_settings
from mtp_train.precompute.vllm_backend import capture_tag, check_writable, final_norm, rows_of
from mtp_train.precompute.writer import folder_spec
from mtp_train.train.checkpoint import CKPT_DIR, LATEST, tag_for
from mtp_train.train.data import MicroBatchStream, PackedBatch, SampleDataset, eval_batches
from mtp_train.train.sources.base import DataSource, make_sampler, online_record, val_or_none
from mtp_train.train.sources.online import OnlineSource, split_rows

log = logging.getLogger(__name__)

EPOCH, VAL = "@epoch", "@val"  # a capture's name: <sample id>@epoch<e> (training) or <sample id>@val (evaluation)
STOP_WAIT_S = 60.0  # at the end, how long the part in flight may take to be answered


def train_name(sample_id: str, epoch: int) -> str:
    """The capture name of a training sample in epoch `epoch`."""
    return f"{sample_id}{EPOCH}{epoch}"


class Ledger:
    """The training samples of one epoch consumed so far: a bitmap over the train split's indices and a count of
    consumptions (a sample consumed twice counts twice, so count == bits set means once each). It is saved with
    every checkpoint (the stream's state), so the one a checkpoint holds is the consumed-and-checkpointed set."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.count = n, 0, 0
        self.bits = bytearray((n + 7) // 8)

    def add(self, epoch: int, indices: list[int]) -> None:
        """Record a consumed batch of `epoch` (a new epoch starts an empty ledger)."""
        if epoch != self.epoch:
            self.reset(epoch)
        for i in indices:
            self.bits[i >> 3] |= 1 << (i & 7)
        self.count += len(indices)

    def reset(self, epoch: int) -> None:
        """An empty ledger of `epoch`."""
        self.epoch, self.count, self.bits = epoch, 0, bytearray(len(self.bits))

    def has(self, i: int) -> bool:
        return bool(self.bits[i >> 3] >> (i & 7) & 1)

    def members(self) -> int:
        """How many distinct samples are in."""
        return sum(bin(b).count("1") for b in self.bits)

    def state(self) -> dict[str, Any]:
        """JSON-able: the epoch, the count and the zlib-compressed bitmap in base64 (at most n/8 bytes)."""
        return {"epoch": self.epoch, "samples": self.count,
                "bitmap": base64.b64encode(zlib.compress(bytes(self.bits))).decode()}

    def load(self, state: dict[str, Any]) -> None:
        bits = zlib.decompress(base64.b64decode(state["bitmap"]))
        if len(bits) != len(self.bits):
            raise ValueError(f"the checkpoint's fleet ledger covers {len(bits) * 8} samples' bits, this run has "
                             f"{self.n} training samples")
        self.epoch, self.count, self.bits = int(state["epoch"]), int(state["samples"]), bytearray(bits)


class FleetStream(MicroBatchStream):
    """The online stream, whose state (in every checkpoint) carries the source's ledger, and which lets the source
    delete what the last checkpoint covers before handing out the next batch."""

    def __init__(self, dataset: SampleDataset, source: FleetSource, cfg: TrainConfig) -> None:
        super().__init__(dataset, make_sampler(dataset.lengths, cfg, 0, 1))
        self.source = source
        self.batches = 0  # micro-batches handed out since the run began (resumes included): step · grad_accum

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {**super().state_dict(), "fleet": self.source.checkpointed(self.batches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        super().load_state_dict(state)
        fleet = state.get("fleet")
        self.batches = int(fleet["batches"]) if fleet else 0
        self.source.resume_ledger(fleet, self.epoch, self.position)

    def next(self) -> PackedBatch:
        self.source.confirm()  # the previous checkpoint is marked by now: what it covers goes
        batch = super().next()
        self.batches += 1
        return batch


@DATA_SOURCES.add
class FleetSource(DataSource):
    """Batches of the conversations of `data.paths`, their hidden states captured by running servers (module
    docstring)."""

    name = "fleet"
    plans_from_conversations = True

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        OnlineSource.check_config(cfg)
        f = cfg.data.fleet
        if not f.endpoints:
            raise ConfigError("data.source=fleet trains from running servers: set data.fleet.endpoints=[http://host:"
                              "port, ...] (vllm serve with our connector: `mtp-precompute ... vllm.serve_command=true "
                              "vllm.spool_dir=DIR` prints the command)")
        if not f.spool_dir:
            raise ConfigError("data.source=fleet needs data.fleet.spool_dir: the folder the servers write their "
                              "captures to, as this machine sees it")
        if f.max_spool_bytes <= 0:
            raise ConfigError(f"data.fleet.max_spool_bytes={f.max_spool_bytes}: must be positive")
        if cfg.train.save_every <= 0:
            raise ConfigError("data.source=fleet deletes a capture once a checkpoint covers it: set train.save_every "
                              "to a positive number of steps")
        if cfg.train.sequence_parallel > 1:
            raise ConfigError(f"data.source=fleet trains in one process, so train.sequence_parallel="
                              f"{cfg.train.sequence_parallel} has no ranks to split a sample over: set "
                              "train.sequence_parallel=1, or train from a precompute folder (data.source=offline)")

    def __init__(self, cfg: TrainConfig, info: DistInfo, device: torch.device) -> None:
        c, f, o = cfg, cfg.data.fleet, cfg.data.online
        self.driver: FleetDriver | None = None
        self.check_config(c)
        if info.world > 1:
            raise ConfigError(f"data.source=fleet trains in one process (world {info.world} here): the servers do "
                              "the heavy part; run mtp-train without torchrun")
        target_dir = Path(c.model.path)
        args = head_target_args(target_dir)  # shapes only: the target runs on the servers
        head = c.head.resolved(args.num_layers)
        aux_layers = list(head.aux_layers) if head.features == "aux" else []
        settings = c.precompute_config(aux_layers)
        check_settings(settings, prefix="data.online.")
        rows, self.data_info = load_rows(load_tokenizer(target_dir), settings, args.vocab_size)
        train_set = split_rows(rows, "train", c)
        if len(train_set) == 0:
            raise ValueError(f"data.source=fleet: every sample of data.paths is in the val split; lower "
                             f"data.online.val_fraction (now {o.val_fraction})")
        val_set = val_or_none(split_rows(rows, "val", c), "data.paths") if c.train.eval_batches > 0 else None
        super().__init__(c, train_set, val_set, FleetStream(train_set, self, c), weights_fingerprint(target_dir),
                         aux_layers, f"data.paths={list(c.data.paths)}")
        self.stream: FleetStream
        self.rows: dict[str, Row] = {r.id: r for r in rows}
        self.index = {sid: i for i, sid in enumerate(train_set.ids)}
        self.val_ids = set(val_set.ids) if val_set is not None else set()
        self.ledger = Ledger(len(train_set))
        self.consumed: list[str] = []  # captures consumed since the last checkpoint's state was taken
        self.pending: tuple[int, list[str]] | None = None  # (batches, captures) of a checkpoint not yet marked

        self.lmap = layer_map(aux_layers, args.num_layers)
        dtype = resolve_dtype(c.model.dtype, args)
        self.norm = final_norm(target_dir, args, dtype)
        spec = folder_spec(args, dtype, target_dir, o.hidden_dtype, aux_layers, backend="vllm")
        self.tag = capture_tag(spec.settings, self.lmap.vllm_ids)  # what a capture of this run carries
        self.storage, self.hidden_size, self.itemsize = o.hidden_dtype, args.hidden_size, dtype.itemsize
        spool = Path(str(f.spool_dir))
        check_writable(spool)
        remove_torn(spool)  # a killed writer's; one writing now loses its file, which is asked for again
        capture = EndpointCapture.connect(
            VllmCaptureConfig(spool_dir=str(spool), endpoints=list(f.endpoints), served_model=f.served_model,
                              concurrency=f.concurrency, timeout=f.timeout, retries=f.retries, backoff=f.backoff,
                              dead_after=f.dead_after, capture_timeout=f.capture_timeout),
            spool, self.tag, self.lmap.vllm_ids, dtype)
        capture.check_lengths(rows)
        keep = self._eval_room()
        need = keep + self._train_room()
        if f.max_spool_bytes < need:
            raise ConfigError(f"data.fleet.max_spool_bytes={f.max_spool_bytes} is below the {need} bytes this run may "
                              f"hold at once: train.save_every={c.train.save_every} steps of captures (deleted once a "
                              "checkpoint covers them) and the next batch, at their worst case, plus an evaluation "
                              "batch: raise it, or lower train.save_every, train.grad_accum or "
                              "train.micro_batch_tokens")
        self.driver = FleetDriver(capture, f.max_spool_bytes, window=f.window, keep=keep)
        self.probe_row = min(train_set.rows, key=lambda r: r.ids.size)  # the cheapest capture to probe with
        log.info("data.source=fleet: %d samples (%d train) from %s, captured through %s into %s (at most %d bytes; "
                 "vLLM layers %s)", len(rows), len(train_set), list(c.data.paths), ", ".join(capture.gen.endpoints),
                 spool, f.max_spool_bytes, list(self.lmap.vllm_ids))

    # -- sizes --

    def bound(self, name: str, row: Row) -> int:
        """The worst case of a capture's file (`spool.capture_bound`)."""
        return capture_bound(int(row.ids.size), len(self.lmap.vllm_ids), self.hidden_size, self.itemsize, name,
                             self.tag)

    def _batch_bound(self, rows: list[Row], name: str) -> int:
        return sum(self.bound(f"{r.id}{name}", r) for r in rows)

    def _eval_room(self) -> int:
        """The worst case of the largest evaluation batch (held back for evaluations), 0 without evaluation."""
        c = self.cfg
        if self.val_set is None or c.train.eval_batches <= 0:
            return 0
        return max((self._batch_bound([self.rows[i] for i in b.ids], VAL)
                    for b in eval_batches(self.val_set, c.train.micro_batch_tokens, c.train.eval_batches,
                                          seed=c.train.seed)), default=0)

    def _train_room(self) -> int:
        """The most bytes training holds at once in epoch 0's plan: any save_every · grad_accum batches consumed
        since the last checkpoint, and the next one (the largest such run of batches). Later epochs group the same
        samples otherwise; `FleetDriver.wait_for` names the settings if one ever does not fit."""
        c = self.cfg.train
        span = c.save_every * c.grad_accum + 1
        sampler = make_sampler(self.train_set.lengths, self.cfg, 0, 1)
        sizes = [self._batch_bound([self.train_set.rows[i] for i in b], f"{EPOCH}0") for b in sampler]
        return max((sum(sizes[i:i + span]) for i in range(max(len(sizes) - span + 1, 1))), default=0)

    # -- the run --

    def begin(self, epoch: int, position: int) -> None:
        """Sort the spool's files (those a checkpoint covers go, this run's later captures are used, others are
        counted), then start asking for the plan from (epoch, position)."""
        assert self.driver is not None
        foreign = 0
        for path in sorted(self.driver.spool.iterdir()):
            if not path.is_file():
                continue
            name = self._ours(path)
            if name is None:
                foreign += path.stat().st_size
                continue
            sid, _, e = name.rpartition(EPOCH)
            i = self.index.get(sid)
            keep = (EPOCH in name and e.isdigit() and i is not None
                    and (int(e) > epoch or (int(e) == epoch and not self.ledger.has(i))))
            if keep:
                self.driver.adopt(name, path.stat().st_size)
            else:
                path.unlink(missing_ok=True)
        self.driver.fixed(foreign)
        if foreign:
            log.warning("data.fleet.spool_dir=%s holds %d bytes of other files; they count against "
                        "data.fleet.max_spool_bytes", self.driver.spool, foreign)
        probe = self.probe_row
        if not self.driver.has_room(self.bound(probe.id, probe)):
            # a killed run's captures fill the spool: they are asked for again, the probe needs the room
            self.driver.drop(list(self.driver.held))
        if not self.driver.has_room(self.bound(probe.id, probe)):
            raise ConfigError(f"{self.driver.spool} holds {foreign} bytes of other files: no room under "
                              f"data.fleet.max_spool_bytes={self.driver.cap} for a probe; empty it or raise the cap")
        # A server of other layers, dtype or folder is refused before the first step.
        self.driver.capture.probe(probe)
        self.driver.start(self._plan(epoch, position))

    def _ours(self, path: Path) -> str | None:
        """The capture name of a file this run's requests wrote (its tag), else None."""
        if not (path.name.startswith(PREFIX) and path.name.endswith(SUFFIX)):
            return None
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
        except Exception:  # noqa: BLE001 - not a capture file
            return None
        return str(meta.get("sample_id")) if meta.get("tag") == self.tag else None

    def _plan(self, epoch: int, position: int) -> Iterator[Wanted]:
        """The captures the rest of the run consumes, in order: the batch plan from (epoch, position) to
        train.max_steps."""
        c = self.cfg.train
        left = c.max_steps * c.grad_accum - self.stream.batches
        e, p = epoch, position
        while left > 0:
            sampler = make_sampler(self.train_set.lengths, self.cfg, 0, 1)
            sampler.set_epoch(e)
            sampler.load_state_dict({"epoch": e, "position": p})
            taken = 0
            for batch in sampler:
                if left <= 0:
                    return
                left, taken = left - 1, taken + 1
                for i in batch:
                    row = self.train_set.rows[i]
                    name = train_name(row.id, e)
                    yield Wanted(name, row, self.bound(name, row))
            if taken == 0 and p == 0:
                return
            e, p = e + 1, 0

    def fill(self, batch: PackedBatch) -> PackedBatch:
        """The batch with its hidden states from its captures (waiting for them), as a folder would store them."""
        assert self.driver is not None
        val = batch.ids[0] in self.val_ids
        rows = [self.rows[sid] for sid in batch.ids]
        names = [f"{sid}{VAL}" if val else train_name(sid, batch.epoch) for sid in batch.ids]
        if val:
            self.driver.urgent(Wanted(n, r, self.bound(n, r)) for n, r in zip(names, rows))
        hidden, aux = [], []
        for name, row in zip(names, rows):
            cap = read_capture(self.driver.wait_for(name))
            with torch.no_grad():
                h, a = rows_of(cap, row, self.lmap, self.norm)  # (n, H), (n, k·H) or None
            hidden.append(h)
            if a is not None:
                aux.append(a)
        if val:
            self.driver.drop(names)  # an evaluation's captures are asked for again at the next one
        else:
            self.ledger.add(batch.epoch, [self.index[sid] for sid in batch.ids])
            self.consumed.extend(names)
        k = len(self.stored_aux_layers)
        return PackedBatch(batch.input_ids, batch.loss_mask, as_stored(torch.cat(hidden), self.storage),
                           batch.seq_lens, batch.ids,
                           as_stored(torch.cat(aux), self.storage, groups=k) if aux else None, batch.epoch)

    # -- checkpoints --

    def checkpointed(self, batches: int) -> dict[str, Any]:
        """The ledger as the checkpoint being written holds it; its captures go once that checkpoint is marked."""
        if self.pending is not None:
            self.consumed = self.pending[1] + self.consumed  # an earlier one never marked: this one covers them
        self.pending, self.consumed = (batches, self.consumed), []
        return {**self.ledger.state(), "batches": batches}

    def confirm(self) -> None:
        """Delete the captures of the pending checkpoint once the run's `latest` marker names it."""
        if self.pending is None or self.driver is None:
            return
        batches, names = self.pending
        marker = Path(self.cfg.out) / CKPT_DIR / LATEST
        step = batches // self.cfg.train.grad_accum
        if marker.is_file() and marker.read_text().strip() == tag_for(step):
            self.driver.drop(names)
            self.pending = None

    def resume_ledger(self, state: dict[str, Any] | None, epoch: int, position: int) -> None:
        """Load a checkpoint's ledger and check it against the plan: the samples of batches [0, position) of
        `epoch`, each once. ValueError when they differ (other data or batch settings)."""
        if state is None:
            raise ValueError("the checkpoint holds no fleet ledger (another data.source's): resume it with that "
                             "source, or start afresh with resume=none")
        self.ledger.load(state)
        if position == 0:  # an epoch's start (a fresh run's): nothing of it consumed
            self.ledger.reset(epoch)
            return
        sampler = make_sampler(self.train_set.lengths, self.cfg, 0, 1)
        sampler.set_epoch(epoch)
        want: set[int] = set()
        count = 0
        for b, batch in enumerate(sampler):
            if b >= position:
                break
            want.update(batch)
            count += len(batch)
        same = self.ledger.epoch == epoch and self.ledger.count == count and all(
            self.ledger.has(i) for i in want) and self.ledger.members() == len(want)
        if not same:
            raise ValueError(f"the checkpoint's fleet ledger (epoch {self.ledger.epoch}, {self.ledger.count} samples) "
                             f"is not the plan's first {position} batches of epoch {epoch} ({count} samples): the "
                             "data or train.micro_batch_tokens / seed changed; resume with the run's settings")

    def record(self) -> dict[str, Any]:
        f = self.cfg.data.fleet
        return {**super().record(), **online_record(self.cfg),
                "data_fleet": {"endpoints": list(f.endpoints), "max_spool_bytes": f.max_spool_bytes}}

    def close(self) -> None:
        """Stop asking; delete what the last checkpoint covers and the captures asked for ahead (asked again if
        the run goes on); keep those consumed since it (a resume uses them)."""
        if self.driver is None:
            return
        self.driver.stop(STOP_WAIT_S)
        self.confirm()
        uncovered = set(self.consumed) | set(self.pending[1] if self.pending else [])
        self.driver.drop([n for n in list(self.driver.held) if n not in uncovered])
        log.info("data.source=fleet: %d captures asked for, the spool's peak %d of %d bytes", self.driver.sent,
                 self.driver.peak, self.driver.cap)
        self.driver = None
