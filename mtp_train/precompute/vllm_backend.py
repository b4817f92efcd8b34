"""`mtp-precompute backend=vllm`: stage one with the hidden states captured inside vLLM.

Our side renders the conversations and their loss masks exactly as `backend=engine` does, and streams them the
same way: `SampleStream` reads and tokenizes `window` conversations at a time, `plan_stream` cuts them into the
same shards under the same names, and the same `FolderWriter` takes each shard as it is planned (`add`). vLLM is
asked only for the hidden states, of the conversations of shards not yet finished whose capture is not on disk
(the whole conversation, prefill only, max_tokens=1): through running servers (`vllm.endpoints`,
`mtp_train.capture.endpoints`) or a vLLM launched in its own environment (`mtp_train.capture.launch`), with our
connector (`mtp_train.capture.vllm_connector`) writing one capture file per conversation. `Streamer` sends a
window of conversations at a time, at least a window ahead of the shard it turns into rows, in plan order, while
vLLM runs on (a conversation's file is deleted once its shard is on disk); at the end vLLM is stopped and the
manifest is written as the engine backend writes it, from the shards' sidecars and counts files. So vLLM starts
within seconds whatever the input's size, and host memory does not grow with the number of conversations: a
launched vLLM is started with the run's `max_seq_len` (at most the target's positions), not the longest
conversation's length, which is not known before the data has been read.

Why files between the two: the connector runs inside vLLM's engine processes, in vLLM's environment, where our
package is not installed; the shard plans, masks and the writer are ours. A capture file is whole or absent
(renamed into place), so a run killed anywhere resumes: finished shards are kept, the captures already on disk
are used, and vLLM is asked only for the rest.

Layers (`mtp_train.capture.layers`): vLLM's aux id L is the last layer's output before the final norm; the
shard's `hidden` (and aux layer L) is the target's own final RMSNorm applied to it here.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

import mtp_train
from mtp_train.capture import launch, serve
from mtp_train.capture.endpoints import EndpointCapture
from mtp_train.capture.layers import LayerMap, layer_map
from mtp_train.capture.spool import PREFIX, SUFFIX, Captured, file_name, read_capture, remove_torn
from mtp_train.config import Interrupted
from mtp_train.config.head import check_aux_layers
from mtp_train.config.precompute import PrecomputeConfig
from mtp_train.data import chat_template_fingerprint, tokenizer_fingerprint
from mtp_train.data.fingerprints import load_tokenizer
from mtp_train.data.samples import Row, SampleStream, checked_rows
from mtp_train.layers.norm import RMSNorm
from mtp_train.models.config import ModelArgs
from mtp_train.models.foreign import FINAL_NORM_NAMES, head_target_args, pick_name
from mtp_train.models.loader import CheckpointReader, checkpoint_files, resolve_dtype
from mtp_train.precompute.manifest import Manifest, ShardInfo
from mtp_train.precompute.plan import RANK_ASSIGNMENT, ShardPlan, plan_stream
from mtp_train.precompute.shards import finished_shard
from mtp_train.precompute.writer import (
    FolderWriter,
    PrecomputeError,
    check_settings,
    dtype_name,
    finished_of_same_settings,
    first_difference,
    folder_spec,
    other_samples,
    refuse_other,
)
from mtp_train.remote.http import RemoteError

log = logging.getLogger(__name__)
PRECOMPUTE_BACKENDS = ("engine", "vllm")  # who runs the target for mtp-precompute (`backend`): ours, or vLLM
POLL_S = 0.5  # how often the driver looks for the next capture while vLLM runs


def final_norm(model_dir: Path, args: ModelArgs, dtype: torch.dtype) -> RMSNorm:
    """The target's final RMSNorm (its weight by the names `models.foreign.FINAL_NORM_NAMES` tries, eps from its
    config), in `dtype`, as ours runs it: y = w · x / rms(x). A family whose final norm is another function (a
    LayerNorm with a bias, Gemma's (1 + w)) is not one this reads right."""
    files = checkpoint_files(model_dir)
    name = pick_name(files, FINAL_NORM_NAMES)
    if name is None:
        raise PrecomputeError(f"{model_dir} has no final norm weight (tried {', '.join(FINAL_NORM_NAMES)}): "
                              "backend=vllm applies the target's final norm to vLLM's last layer itself and needs it")
    bias = name.removesuffix(".weight") + ".bias"
    if bias in files:
        raise PrecomputeError(f"{model_dir}: the final norm has a bias ({bias}, a LayerNorm): backend=vllm applies "
                              "an RMSNorm to vLLM's last layer")
    with CheckpointReader({name: files[name]}) as reader:
        weight = reader.read(name, dtype)
    norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def check_vllm_python(python: str | Path) -> Path:
    """vLLM's python (`launch.check_python`), a PrecomputeError when it is missing: checked before `out` is made."""
    try:
        return launch.check_python(python)
    except launch.CaptureError as e:
        raise PrecomputeError(str(e)) from None


def capture_tag(settings: dict[str, Any], vllm_ids: tuple[int, ...]) -> str:
    """What a capture file must have been made with to be used (the shards' settings and vLLM's layer ids). The
    settings' `backend` is left out: every capture file is vLLM's, so it says nothing a file must match."""
    settings = {k: v for k, v in settings.items() if k != "backend"}
    return hashlib.sha256(json.dumps([settings, list(vllm_ids)], sort_keys=True).encode()).hexdigest()[:16]


def rows_of(cap: Captured, row: Row, lmap: LayerMap, norm: Callable[[torch.Tensor], torch.Tensor],
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A capture as the shard's rows: hidden (n, H) and aux (n, k·H) or None, in the capture's dtype.

    Refuses (PrecomputeError) a capture of other token ids (the first differing position named) or other layers.
    """
    ids = cap.token_ids.tolist()
    want = row.ids.tolist()
    if ids != want:
        at = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
        raise PrecomputeError(f"sample {row.id!r}: vLLM ran other token ids than our rendering ({len(ids)} vs "
                              f"{len(want)} tokens, first difference at position {at})")
    if list(cap.layer_ids) != list(lmap.vllm_ids) or cap.hidden_states.shape[:2] != (len(want), len(lmap.vllm_ids)):
        raise PrecomputeError(f"sample {row.id!r}: captured layers {cap.layer_ids} of shape "
                              f"{tuple(cap.hidden_states.shape)}, expected {list(lmap.vllm_ids)}")
    states = cap.hidden_states  # (n, len(vllm_ids), H)
    normed = norm(states[:, lmap.hidden[0]])  # (n, H): the final norm over vLLM's last layer

    def pick(index: int, apply_norm: bool) -> torch.Tensor:
        return normed if apply_norm else states[:, index]

    aux = torch.cat([pick(i, n) for i, n in lmap.aux], dim=-1) if lmap.aux else None  # (n, k*H)
    return normed, aux


def usable(path: Path, tag: str, row: Row) -> bool:
    """Whether a capture file on disk is this run's (its tag and token count; the ids are checked when read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            n = f.get_slice("token_ids").get_shape()[0]
    except Exception:  # noqa: BLE001 - unreadable: captured again
        return False
    return meta.get("tag") == tag and meta.get("sample_id") == row.id and n == row.ids.size


def check_writable(folder: Path) -> None:
    """Create the capture folder and write a probe in it; a one-line PrecomputeError when that fails."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        raise PrecomputeError(f"the capture folder {folder} is not writable ({e.strerror or e}): vLLM's connector "
                              "writes there; choose vllm.spool_dir=<a writable folder>") from None


def max_model_len(cfg: PrecomputeConfig, args: ModelArgs) -> int:
    """The launched vLLM's max_model_len: a conversation of the run's `max_seq_len` tokens (the most `SampleStream`
    keeps) and its one sampled token, at most the target's positions (vLLM refuses a longer context). Known before
    any conversation is read, so prompts are sent as they are read."""
    return min(cfg.max_seq_len + 1, args.max_position_embeddings)


def vllm_request(cfg: PrecomputeConfig, model_dir: Path, dtype: torch.dtype, lmap: LayerMap, spool: Path,
                 tag: str, context: int) -> dict[str, Any]:
    """The `vllm_run` request (its prompts go to the child's stdin); context: its max_model_len (`max_model_len`)."""
    v = cfg.vllm
    engine = v.llm_kwargs(max_num_seqs=v.max_num_seqs, max_num_batched_tokens=v.max_num_batched_tokens)
    return {"model": str(model_dir.resolve()), "dtype": dtype_name(dtype), "layer_ids": list(lmap.vllm_ids),
            "max_model_len": int(context), "spool_dir": str(spool.resolve()), "tag": tag, "engine": engine}


class CaptureSource(Protocol):
    """What writes the capture files the driver waits for: the vLLM process it launched (`launch.VllmProcess`) or
    running servers (`capture.endpoints.EndpointCapture`)."""

    def wait(self, seconds: float) -> None: ...

    def check(self, sample_id: str, path: Path) -> None: ...


class CaptureSink(CaptureSource, Protocol):
    """A `CaptureSource` the driver hands conversations to as it reads them (`Streamer`)."""

    def check_lengths(self, rows: Sequence[Row]) -> None: ...  # refuses a conversation it cannot take

    def put(self, rows: Sequence[Row]) -> None: ...  # capture these, in order, without blocking the driver

    def close(self) -> None: ...  # no more conversations

    def taken(self, sample_id: str) -> None: ...  # the driver has read this capture

    def finish(self) -> None: ...  # after close, every capture read: raises what failed meanwhile

    def stop(self) -> None: ...  # end now (always called)


def wait_for(path: Path, source: CaptureSource | None, sample_id: str) -> Path:
    """Wait until vLLM's connector has written `path` (whole: files are renamed into place); raises CaptureError
    when its source says it cannot come any more (or there is none)."""
    while not path.is_file():
        if source is None:
            raise launch.CaptureError(f"no capture of sample {sample_id!r} in {path.parent} and vLLM is not running")
        source.wait(POLL_S)
        if path.is_file():
            break
        source.check(sample_id, path)
    return path


def precompute_vllm(cfg: PrecomputeConfig, *, environ: Mapping[str, str], config_dict: dict[str, Any],
                    on_start: Callable[[], None] | None = None, stream: SampleStream | None = None,
                    on_shard: Callable[[ShardInfo, bool], None] | None = None) -> Manifest:
    """Run stage one through vLLM as `cfg` says (one process; module docstring); returns the manifest. vLLM's
    failures (not installed, a model it cannot serve, a crash) are PrecomputeErrors naming its log.

    Args:
        cfg: the command's settings (model.path, data, out, aux_layers, hidden_dtype, shard_tokens, vllm_python,
            vllm.*).
        environ: the environment vLLM's process starts from (its PYTHONPATH is replaced, see `launch.child_env`).
        config_dict: the resolved config, recorded in the manifest's provenance.
        on_start: called once the first window of the data is read, the settings checked and the servers of
            `vllm.endpoints` probed (when the first window has a conversation to capture), before anything in
            `cfg.out` changes; never when `cfg.out` already holds this capture, finished (its manifest is returned
            and nothing is written).
        stream: the samples, read once (None: `SampleStream` over `cfg.data`, `cfg.window` conversations at a
            time); its `info` is the manifest's `data`.
        on_shard: called with (the shard's sidecar info, skipped) after each shard is written (skipped=False) or
            found finished by a previous run (skipped=True), as `FolderWriter` calls it; an exception from it stops
            the run, which resumes later.
    """
    try:
        return capture_stage(cfg, environ, config_dict, on_start, stream, on_shard)
    except (launch.CaptureError, RemoteError) as e:
        raise PrecomputeError(str(e)) from None


def capture_stage(cfg: PrecomputeConfig, environ: Mapping[str, str], config_dict: dict[str, Any],
                  on_start: Callable[[], None] | None, stream: SampleStream | None = None,
                  on_shard: Callable[[ShardInfo, bool], None] | None = None) -> Manifest:
    """`precompute_vllm`'s work, raising CaptureError for vLLM's failures."""
    check_settings(cfg)
    python = None if cfg.vllm.endpoints else launch.check_python(cfg.vllm_python)  # servers run elsewhere
    model_dir = Path(cfg.model.path)
    args = head_target_args(model_dir)  # a target no family here runs is read for its shapes only
    aux_layers = [int(j) for j in cfg.aux_layers]
    check_aux_layers(aux_layers, args.num_layers)
    lmap = layer_map(aux_layers, args.num_layers)
    dtype = resolve_dtype(cfg.model.dtype, args)
    tokenizer = load_tokenizer(model_dir)
    stream = SampleStream(tokenizer, cfg, window=cfg.window) if stream is None else stream
    rows = checked_rows(stream, args.vocab_size)
    first = next(rows, None)  # the first window is read here: its bad rows are refused before any write
    if first is None:
        raise ValueError("no samples to precompute")
    out = Path(cfg.out)
    spool = Path(cfg.vllm.spool_dir) if cfg.vllm.spool_dir else out / "capture"
    spec = folder_spec(args, dtype, model_dir, cfg.hidden_dtype, aux_layers, backend="vllm")
    plans = plan_stream(itertools.chain([first], rows), 0, 1, cfg.shard_tokens, spec.settings)
    finished = finished_of_same_settings(out, spec, 1, cfg)
    if finished is not None:
        # Compared shard by shard as they are planned, writing nothing: this very capture, finished, is returned
        # (nothing to ask vLLM, nothing to write), another is refused naming its first differing shard.
        diff = first_difference(out, finished, plans, 0, 1)
        if diff is not None:
            refuse_other(out, [other_samples(finished, diff)])
        log.debug("%s already holds this precompute (finished %s): nothing to do", out, finished.created_at)
        return finished
    norm = final_norm(model_dir, args, dtype)
    tag = capture_tag(spec.settings, lmap.vllm_ids)

    def drop_captures(shard: ShardInfo, skipped: bool) -> None:
        for sample_id in streamer.shard_ids.pop(shard.file, ()):  # on disk in a shard: its captures go
            (spool / file_name(sample_id)).unlink(missing_ok=True)
        if on_shard is not None:
            on_shard(shard, skipped)

    writer = FolderWriter(out, spec, rank=0, verify=cfg.verify_on_resume, on_shard=drop_captures,
                          split=(cfg.seed, cfg.val_fraction))
    made = [d for d in (spool, *spool.parents) if not d.exists()]  # the capture folders this run creates
    served: dict[str, Any] | None = None  # the endpoints captured through (provenance)
    context = max_model_len(cfg, args)
    with contextlib.ExitStack() as stack:

        def open_sink() -> CaptureSink:
            """Start capturing (at the first conversation without a usable capture file): probe the servers of
            `vllm.endpoints`, or launch vLLM."""
            nonlocal served
            if cfg.vllm.endpoints:
                assert streamer.first_missing is not None  # set before the sink is opened
                remote = EndpointCapture.connect(cfg.vllm, spool, tag, lmap.vllm_ids, dtype)
                stack.callback(remote.stop)
                remote.check_lengths([streamer.first_missing])
                remote.probe(streamer.first_missing)
                served = remote.provenance()
                remote.open()
                return remote
            assert python is not None
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mtp-capture-")))
            env = launch.child_env(environ, launch.stage_modules(tmp / "modules"), cfg.vllm.cpu_kvcache_gb)
            proc = launch.start(python, vllm_request(cfg, model_dir, dtype, lmap, spool, tag, context), tmp, env,
                                out / "vllm-capture.log")
            # A refused or interrupted run stops vLLM (and its engine processes) here.
            stack.callback(proc.stop)
            return proc

        streamer = Streamer(writer, spool, tag, lmap, norm, open_sink, cfg.window)
        try:
            check_writable(spool)
            remove_torn(spool)
            plans = streamer.peek(plans, out)
            if cfg.vllm.endpoints and streamer.first_missing is not None:
                # The servers are asked and probed before the run writes anything: a refused one leaves no
                # config.yaml and no folder behind.
                streamer.open()
            writer.begin(owner=True, on_start=on_start)
            log.info("precompute through vLLM: %s → %s, %d conversations read and tokenized at a time",
                     list(cfg.data.paths), out, cfg.window)
            streamer.run(plans)
            writer.finish()
        except BaseException as exc:
            for d in made:  # deepest first; one that holds captures stays for the re-run
                try:
                    d.rmdir()
                except OSError:
                    break
            if isinstance(exc, KeyboardInterrupt):
                raise Interrupted(f"after {len(writer.done)} shards were written to {out}; re-run the same command "
                                  f"to go on from there (finished shards and captures in {spool} are kept)") from None
            raise
        finally:
            writer.close()
    log.info("precompute through vLLM: %d conversations captured, %d shards kept from before",
             streamer.captured, streamer.kept)
    remove_torn(spool)
    if cfg.vllm.spool_dir is None:
        # The folder is ours and every shard is written: what is left are captures of conversations no longer in
        # the data (an earlier run's).
        for stale in spool.glob(f"{PREFIX}*{SUFFIX}"):
            stale.unlink()
        with contextlib.suppress(OSError):
            spool.rmdir()
    prov = {"package_version": mtp_train.__version__, "torch_version": torch.__version__,
            "settings": {"world": 1, "tp": 1, "shard_tokens": cfg.shard_tokens, "batch_tokens": cfg.batch_tokens,
                         "rank_assignment": RANK_ASSIGNMENT, "backend": "vllm", "vllm_layer_ids": list(lmap.vllm_ids),
                         **({"servers": served} if served else {})},
            "package": "mtp_train", "version": mtp_train.__version__, "config": config_dict}
    # From what the shards record (their sidecars and counts files), as the engine backend writes it: no row held.
    return writer.write_streamed_manifest(
        writer.entries, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        chat_template_fingerprint=chat_template_fingerprint(tokenizer), data_info=dict(stream.info),
        val_fraction=cfg.val_fraction, seed=cfg.seed, provenance=prov)


class Streamer:
    """Captures the conversations of the shards as they are planned and turns the captures into rows, in plan
    order (module docstring). The conversations to capture go to vLLM a window at a time; a shard is converted
    once at least a window of conversations is planned (and sent) after it, so vLLM always has the next window
    while the driver waits for a shard's captures, and the rows held are the shard being converted, about a window
    after it and the stream's own window.

    Args:
        writer: the folder's writer, after `begin` when `run` is called.
        spool: the capture folder.
        tag: the run's tag (`capture_tag`): a capture file of another is captured again.
        lmap: the run's layers in vLLM's numbering.
        norm: the target's final norm (`final_norm`).
        open_sink: starts capturing (probes the servers or launches vLLM); called once, at the first conversation
            without a usable capture (`first_missing`), never when every conversation has one.
        window: conversations sent at a time.
    """

    def __init__(self, writer: FolderWriter, spool: Path, tag: str, lmap: LayerMap,
                 norm: Callable[[torch.Tensor], torch.Tensor], open_sink: Callable[[], CaptureSink],
                 window: int) -> None:
        self.writer, self.spool, self.tag, self.lmap, self.norm = writer, spool, tag, lmap, norm
        self.open_sink, self.window = open_sink, max(1, window)
        self.sink: CaptureSink | None = None
        self.first_missing: Row | None = None  # the first conversation to capture (the probe's)
        self.shard_ids: dict[str, list[str]] = {}  # shard file → its sample ids, until the shard is on disk
        self._pending: deque[tuple[ShardPlan, int]] = deque()  # planned shards to convert, with their send number
        self._ahead = 0  # conversations of the pending shards
        self._unsent: list[Row] = []  # conversations to capture, not yet handed to the sink
        self._sends = 0  # parts handed to the sink so far
        self.captured = 0  # conversations sent to vLLM
        self.kept = 0  # shards a previous run finished

    def _missing(self, plan: ShardPlan) -> list[Row]:
        return [r for r in plan.rows if not usable(self.spool / file_name(r.id), self.tag, r)]

    def peek(self, plans: Iterable[ShardPlan], out: Path) -> Iterator[ShardPlan]:
        """Read `plans` up to the first conversation to capture of a shard not finished yet (`first_missing`), or
        about a window of conversations, writing nothing; returns the same plans, from the first."""
        plans = iter(plans)
        seen: list[ShardPlan] = []
        rows = 0
        for plan in plans:
            seen.append(plan)
            rows += len(plan.rows)
            if finished_shard(out, plan, verify=False) is None:
                self.first_missing = next(iter(self._missing(plan)), None)
            if self.first_missing is not None or rows >= self.window:
                break
        return itertools.chain(seen, plans)

    def open(self) -> CaptureSink:
        """The sink, started at the first call."""
        if self.sink is None:
            self.sink = self.open_sink()
        return self.sink

    def run(self, plans: Iterable[ShardPlan]) -> None:
        """Capture and record every shard of `plans` not finished yet (`FolderWriter.add`), then end the sink."""
        for plan in plans:
            # Known before `add`: a shard a previous run finished drops its leftover captures there.
            self.shard_ids[plan.name] = [r.id for r in plan.rows]
            if not self.writer.add(plan):
                self.kept += 1
                continue
            self._unsent += self._missing(plan)
            # The part that will carry this shard's last conversations to capture (the next one sent).
            self._pending.append((plan, self._sends + 1))
            self._ahead += len(plan.rows)
            if len(self._unsent) >= self.window:
                self._send()
            while self._pending and self._ahead - len(self._pending[0][0].rows) >= self.window:
                self._convert(*self._pending.popleft())
        self._send()
        if self.sink is not None:
            self.sink.close()
        while self._pending:
            self._convert(*self._pending.popleft())
        if self.sink is not None:
            self.sink.finish()

    def _send(self) -> None:
        if not self._unsent:
            return
        if self.first_missing is None:
            self.first_missing = self._unsent[0]
        sink = self.open()
        sink.check_lengths(self._unsent)
        sink.put(self._unsent)
        self._sends += 1
        self.captured += len(self._unsent)
        self._unsent = []

    def _convert(self, plan: ShardPlan, part: int) -> None:
        """Record `plan`'s conversations from their capture files (waiting for them); its shard then goes to
        disk. part: the number of the part that carries its conversations."""
        self._ahead -= len(plan.rows)
        if part > self._sends:  # its conversations are still waiting to be sent
            self._send()
        for row in plan.rows:
            cap = read_capture(wait_for(self.spool / file_name(row.id), self.sink, row.id))
            if self.sink is not None:
                self.sink.taken(row.id)
            with torch.inference_mode():
                hidden, aux = rows_of(cap, row, self.lmap, self.norm)
            self.writer.record([row.id], [int(row.ids.size)], hidden, aux)


def serve_command(cfg: PrecomputeConfig) -> str:
    """`vllm.serve_command=true`: the shell line that starts a `vllm serve` capturing for these settings (their
    layers, dtype and max_seq_len + 1 as its context) into `vllm.spool_dir`, with the capture modules staged in
    `<spool_dir>/.modules` (the servers see that folder already: they write beside it)."""
    if not cfg.vllm.spool_dir:
        raise ValueError("vllm.serve_command needs vllm.spool_dir: the shared folder the servers will write to")
    model_dir = Path(cfg.model.path).resolve()
    args = head_target_args(model_dir)
    aux_layers = [int(j) for j in cfg.aux_layers]
    check_aux_layers(aux_layers, args.num_layers)
    spool = Path(cfg.vllm.spool_dir).resolve()
    modules = launch.stage_modules(spool / ".modules")
    v = cfg.vllm
    extra = [f"--tensor-parallel-size={v.tensor_parallel_size}", f"--max-num-seqs={v.max_num_seqs}"]
    if v.gpu_memory_utilization is not None:
        extra.append(f"--gpu-memory-utilization={v.gpu_memory_utilization}")
    argv = serve.serve_argv("python", model_dir, layer_map(aux_layers, args.num_layers).vllm_ids, spool,
                            dtype=dtype_name(resolve_dtype(cfg.model.dtype, args)), max_model_len=cfg.max_seq_len + 1,
                            enforce_eager=v.enforce_eager, host="0.0.0.0", extra=extra)
    return (f"# with vLLM's python (in its environment); then: mtp-precompute backend=vllm "
            f"vllm.endpoints=[http://<host>:8000] vllm.spool_dir={spool} (same settings)\n"
            + serve.shell_line(argv, modules))
