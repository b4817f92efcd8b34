"""`mtp-train data.source=fleet` without vLLM: stand-in servers that write real capture files with our engine (as a
vLLM with our connector would, `tests.test_capture._CapturingServer`) feed training through a spool folder kept
under a byte cap smaller than the data; the head equals an offline run's on a `backend=vllm` precompute of the same
conversations; a trainer killed with SIGKILL resumes with every sample consumed exactly once (the checkpoint's
ledger); a server that dies mid-run leaves the rest to the other endpoint.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from mtp_train.capture.layers import layer_map
from mtp_train.capture.spool import capture_bound, write_capture
from mtp_train.cli.common import CONF_DIR
from mtp_train.cli.precompute import precompute_main
from mtp_train.cli.train import train_main
from mtp_train.config import ConfigError, register_configs
from mtp_train.data.sampler import LengthBucketedBatchSampler
from mtp_train.train.trainer import Trainer
from tests.conftest import make_chat_target
from tests.test_capture import LAYERS, _CapturingServer
from tests.test_capture_endpoints import _DyingServer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")

IDS = layer_map([], LAYERS).vllm_ids  # an mtp head reads the final hidden state only: vLLM's id L
MBT = 128  # train.micro_batch_tokens
SAMPLES = ["data.online.max_seq_len=64", "data.online.val_fraction=0.0", "data.online.hidden_dtype=float32"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleet")
    target = make_chat_target(root / "target", num_layers=LAYERS)
    rows = [{"id": f"f{i:02d}", "messages": [
        {"role": "user", "content": f"Tell me about topic {i}."},
        {"role": "assistant", "content": "Here is a fact about it. " * (1 + i % 4)}]} for i in range(16)]
    convs = root / "convs.jsonl"
    convs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "target": target, "convs": convs}


def _compose(name: str, overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(name, overrides=overrides)


def _overrides(world: dict[str, Path], out: Path, steps: int, *extra: str) -> list[str]:
    return [f"model.path={world['target']}", "model.device=cpu", "model.backend=torch", "model.dtype=float32",
            f"data.paths=[{world['convs']}]", *SAMPLES, f"out={out}", "wandb.mode=disabled", "train.progress=false",
            f"train.micro_batch_tokens={MBT}", f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0",
            "train.eval_batches=0", "train.save_every=1", "optim.lr=1e-2", "optim.warmup_steps=2",
            "spec_eval.prompts=[]", "head=mtp", *extra]


def _fleet(spool: Path, urls: list[str], cap: int) -> list[str]:
    return ["data.source=fleet", f"data.fleet.endpoints=[{','.join(urls)}]", f"data.fleet.spool_dir={spool}",
            f"data.fleet.max_spool_bytes={cap}", "data.fleet.window=4", "data.fleet.concurrency=2",
            "data.fleet.capture_timeout=30", "data.fleet.retries=2"]


def _epoch_batches(world: dict[str, Path]) -> tuple[int, int, int]:
    """(batches of epoch 0, samples, bytes of every sample's capture at its worst case)."""
    from omegaconf import OmegaConf

    from mtp_train.config import TrainConfig
    from mtp_train.data.chat import load_tokenizer
    from mtp_train.data.samples import load_rows
    from mtp_train.train.sources.fleet import train_name

    cfg = OmegaConf.to_object(_compose("train", _overrides(world, world["root"] / "x", 1)))
    assert isinstance(cfg, TrainConfig)
    tok = load_tokenizer(world["target"])
    rows, _ = load_rows(tok, cfg.precompute_config([]), len(tok))
    lengths = [int(r.ids.size) for r in rows]
    total = sum(capture_bound(n, len(IDS), 32, 4, train_name(r.id, 0), "0" * 16) for n, r in zip(lengths, rows))
    return len(LengthBucketedBatchSampler(lengths, MBT, shuffle=True, seed=0)), len(rows), total


def _head(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "heads" / f"step-{step}" / "model.safetensors"))


def _same_head(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def _ledger(out: Path, step: int) -> tuple[int, int]:
    """(consumptions, distinct samples) of checkpoint `step`'s fleet ledger."""
    state = json.loads((out / "checkpoints" / f"step-{step}" / "state.json").read_text())
    fleet = state["client"]["data"]["fleet"]
    bits = zlib.decompress(base64.b64decode(fleet["bitmap"]))
    return int(fleet["samples"]), sum(bin(b).count("1") for b in bits)


def _spool_bytes(spool: Path) -> int:
    return sum(p.stat().st_size for p in spool.iterdir() if p.is_file()) if spool.is_dir() else 0


@pytest.fixture(scope="module")
def fleet_run(world) -> dict:
    """One epoch through one server, the spool capped at a third of the data's captures; the driver's count and
    the folder's listing sampled at every step."""
    batches, samples, data_bytes = _epoch_batches(world)
    cap = data_bytes // 3
    out, spool = world["root"] / "fleet", world["root"] / "spool"
    seen: list[tuple[int, int, int]] = []

    def hook(trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        driver = trainer.data.driver
        seen.append((driver.used, driver.peak, _spool_bytes(spool)))

    with _CapturingServer(world["target"], spool, IDS) as server:
        train_main(_compose("train", _overrides(world, out, batches, *_fleet(spool, [server.url], cap))),
                   on_step=hook)
    return {"out": out, "spool": spool, "cap": cap, "seen": seen, "batches": batches, "samples": samples,
            "data_bytes": data_bytes, "requests": server.requests}


def test_fleet_training_stays_under_the_spool_cap_and_equals_the_file_path(world, fleet_run, tmp_path):
    run = fleet_run
    assert run["cap"] < run["data_bytes"]
    assert len(run["seen"]) == run["batches"]
    for used, peak, listed in run["seen"]:
        assert listed <= used <= peak <= run["cap"], (listed, used, peak, run["cap"])
    assert max(listed for _, _, listed in run["seen"]) > 0
    assert run["requests"] == run["samples"] + 1  # each sample once, and the probe
    assert not list(run["spool"].glob("req-*"))  # every capture deleted once the last checkpoint covered it
    assert _ledger(run["out"], run["batches"]) == (run["samples"], run["samples"])

    # The file path: mtp-precompute backend=vllm through the same kind of server, then data.source=offline.
    spool, folder = tmp_path / "spool", tmp_path / "pc"
    with _CapturingServer(world["target"], spool, IDS) as server:
        precompute_main(_compose("precompute", [
            f"model.path={world['target']}", "model.device=cpu", "model.dtype=float32",
            f"data.paths=[{world['convs']}]",
            f"out={folder}", "progress=false", "max_seq_len=64", "val_fraction=0.0", "hidden_dtype=float32",
            "backend=vllm", f"vllm.endpoints=[{server.url}]", f"vllm.spool_dir={spool}",
            f"vllm_python={tmp_path / 'no-vllm'}"]))
    offline = tmp_path / "offline"
    train_main(_compose("train", _overrides(world, offline, run["batches"], "data.source=offline",
                                             f"data.dir={folder}")))
    _same_head(_head(offline, run["batches"]), _head(run["out"], run["batches"]))


class _GatedServer(_CapturingServer):
    """`_CapturingServer` that answers its first `answers` POSTs, then holds every later one until `gate` is set."""

    def __init__(self, *args, answers: int, **kw) -> None:
        super().__init__(*args, **kw)
        owner, lock, self.posts, self.gate = self, threading.Lock(), 0, threading.Event()

        class Gated(self.httpd.RequestHandlerClass):
            def do_POST(self) -> None:
                with lock:
                    owner.posts += 1
                    n = owner.posts
                if n > answers:
                    owner.gate.wait(120)
                super().do_POST()

        self.httpd.RequestHandlerClass = Gated


def _wait(what, seconds: float = 300.0) -> None:
    """A bounded wait for a condition another process brings about."""
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)


def test_a_trainer_killed_with_sigkill_resumes_with_every_sample_once(world, fleet_run, tmp_path):
    batches, samples = fleet_run["batches"], fleet_run["samples"]
    out, spool = tmp_path / "run", tmp_path / "spool"
    overrides = _overrides(world, out, batches, *_fleet(spool, ["URL"], fleet_run["cap"]))
    with _GatedServer(world["target"], spool, IDS, answers=1 + samples // 2) as server:
        argv = [a.replace("URL", server.url) for a in overrides]
        log = open(tmp_path / "killed.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen([sys.executable, "-m", "mtp_train.cli.train", *argv], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ) | {"OMP_NUM_THREADS": "1"})
        latest = out / "checkpoints" / "latest"
        try:
            # killed while it waits for held captures, with at least one checkpoint written
            _wait(lambda: proc.poll() is not None or (server.posts > 1 + samples // 2 and latest.is_file()))
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-2000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            log.close()
            server.gate.set()  # the held requests are answered to no one, their captures land in the spool
        killed_at = int(latest.read_text().strip().removeprefix("step-"))
        assert 0 < killed_at < batches
        assert _ledger(out, killed_at)[0] == _ledger(out, killed_at)[1] < samples
        train_main(_compose("train", [a.replace("URL", server.url) for a in overrides]))  # resume=auto
    assert _ledger(out, batches) == (samples, samples)  # every sample consumed once, none lost
    _same_head(_head(fleet_run["out"], batches), _head(out, batches))
    assert not list(spool.glob("req-*"))


def test_a_server_dying_mid_run_leaves_the_rest_to_the_other(world, fleet_run, tmp_path):
    batches, samples = fleet_run["batches"], fleet_run["samples"]
    out, spool = tmp_path / "run", tmp_path / "spool"
    with _CapturingServer(world["target"], spool, IDS) as live, \
            _DyingServer(world["target"], spool, IDS, answers=3) as dying:
        train_main(_compose("train", _overrides(world, out, batches, *_fleet(spool, [dying.url, live.url],
                                                                             fleet_run["cap"]),
                                                 "data.fleet.backoff=0.05", "data.fleet.dead_after=1.0")))
        assert dying.requests == 3 and dying.posts > 3
        assert dying.requests + live.requests == samples + 2  # every sample captured once, and the two probes
    assert _ledger(out, batches) == (samples, samples)
    _same_head(_head(fleet_run["out"], batches), _head(out, batches))


def test_fleet_settings_are_refused_by_key(world, tmp_path):
    spool = tmp_path / "spool"
    base = _overrides(world, tmp_path / "out", 2)
    with pytest.raises(ConfigError, match="data.fleet.endpoints"):
        train_main(_compose("train", [*base, "data.source=fleet", f"data.fleet.spool_dir={spool}"]))
    with _CapturingServer(world["target"], spool, IDS) as server:
        with pytest.raises(ConfigError, match="data.fleet.max_spool_bytes=1000 is below"):
            train_main(_compose("train", [*base, *_fleet(spool, [server.url], 1000)]))
        assert server.requests == 0  # refused before any capture
        write_capture(spool, "other", torch.zeros(2, dtype=torch.long), torch.zeros(2, 1, 4), [3], tag="x")
    with pytest.raises(ConfigError, match="data.fleet.transport='mooncake'"):
        train_main(_compose("train", [*base, "data.source=fleet", "data.fleet.transport=mooncake"]))
