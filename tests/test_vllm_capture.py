"""The capture through a real vLLM (its CPU build, in its own venv): the default model's hidden states as vLLM
computes them land in the shards our engine writes, within fp32 reordering error. Skipped when there is no vLLM
venv (`make vllm-venv`; or VLLM_PYTHON=<its python>)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mtp_train.config import PrecomputeConfig
from mtp_train.config.data import DataConfig
from mtp_train.config.model import ModelConfig
from mtp_train.data.chat import load_tokenizer
from mtp_train.models import load_model
from mtp_train.precompute.pipeline import run_precompute
from mtp_train.precompute.vllm_backend import precompute_vllm

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")).absolute()
AUX = [0, 2, 15, 30]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv, or VLLM_PYTHON)")
def test_vllm_capture_matches_our_engine(default_model_dir, tmp_path):
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Name {i + 2} colours."},
        {"role": "assistant", "content": "Red, green and blue are three of them."}]}) + "\n" for i in range(2)))

    def cfg(out: Path, **kw) -> PrecomputeConfig:
        return PrecomputeConfig(model=ModelConfig(path=str(default_model_dir), dtype="float32"),
                                data=DataConfig(paths=[str(convs)]), out=str(out), aux_layers=AUX,
                                hidden_dtype="float32", val_fraction=0.0, progress=False, **kw)

    ours = cfg(tmp_path / "ours")
    run_precompute(load_model(default_model_dir, dtype="float32"), load_tokenizer(default_model_dir),
                   default_model_dir, ours, rank=0, world=1, tp_rank=0, tp_size=1, config_dict={})
    theirs = cfg(tmp_path / "vllm", backend="vllm", vllm_python=str(VLLM_PYTHON))
    precompute_vllm(theirs, environ=dict(os.environ), config_dict={})
    name = "shard-r0-00000.safetensors"
    with safe_open(str(tmp_path / "ours" / name), "pt") as a, safe_open(str(tmp_path / "vllm" / name), "pt") as b:
        assert a.metadata()["sample_ids"] == b.metadata()["sample_ids"]
        for key in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(a.get_tensor(key), b.get_tensor(key))
        for key in ("hidden", "aux_hidden"):
            torch.testing.assert_close(b.get_tensor(key), a.get_tensor(key), rtol=1e-3, atol=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv, or VLLM_PYTHON)")
def test_a_model_vllm_cannot_serve_is_one_line(tmp_path):
    from mtp_train.precompute import PrecomputeError
    from tests.conftest import make_chat_target

    target = make_chat_target(tmp_path / "target", num_layers=2)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    convs = tmp_path / "convs.jsonl"
    convs.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Tell me about owls."},
                                                         {"role": "assistant", "content": "Owls fly."}]}) + "\n")
    cfg = PrecomputeConfig(model=ModelConfig(path=str(target), dtype="float32", fetch=None),
                           data=DataConfig(paths=[str(convs)]), out=str(tmp_path / "out"), backend="vllm",
                           vllm_python=str(VLLM_PYTHON), progress=False)
    with pytest.raises(PrecomputeError, match=r"vLLM cannot serve .*NoSuchForCausalLM.* are not supported") as e:
        precompute_vllm(cfg, environ=dict(os.environ), config_dict={})
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


# --- a finished capture folder: never rewritten by a run that captures nothing, never taken for another backend's


def _captures_of(cfg: PrecomputeConfig, spool: Path) -> None:
    """The capture files vLLM's connector would write for cfg's conversations, with the run's tag. Their states are
    random (of the right shape and dtype): what is tested is what the run writes around them, not their values."""
    from mtp_train.capture.layers import layer_map
    from mtp_train.capture.spool import write_capture
    from mtp_train.data.samples import build_samples, to_rows
    from mtp_train.models.foreign import head_target_args
    from mtp_train.precompute.vllm_backend import capture_tag
    from mtp_train.precompute.writer import folder_spec

    model_dir = Path(cfg.model.path)
    args = head_target_args(model_dir)
    lmap = layer_map(list(cfg.aux_layers), args.num_layers)
    spec = folder_spec(args, torch.float32, model_dir, cfg.hidden_dtype, cfg.aux_layers, backend="vllm")
    gen = torch.Generator().manual_seed(0)
    for r in to_rows(build_samples(load_tokenizer(model_dir), cfg)[0], args.vocab_size):
        states = torch.randn(r.ids.size, len(lmap.vllm_ids), args.hidden_size, generator=gen)  # (n, k, H)
        write_capture(spool, r.id, torch.from_numpy(r.ids), states, list(lmap.vllm_ids),
                      tag=capture_tag(spec.settings, lmap.vllm_ids))


def _files(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by its path inside it."""
    import hashlib

    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_finished_capture_is_left_byte_for_byte_by_a_rerun_and_refused_to_the_engine(tmp_path):
    """A capture folder finished through vLLM (here from capture files already in the spool, so that the dead
    endpoint is never asked): the same command again says there is nothing to do and changes no byte; our engine's
    precompute into it is refused naming the backend (one line, exit 2), and changes no byte either."""
    import subprocess
    import sys

    from tests.conftest import make_chat_target

    target = make_chat_target(tmp_path / "target")
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Tell me about {topic}."},
        {"role": "assistant", "content": f"Here is a fact about {topic}."}]}) + "\n"
        for i, topic in enumerate(["owls", "tea", "maps"])))
    out, spool = tmp_path / "pc", tmp_path / "shared"
    settings = [f"model.path={target}", "model.fetch=null", "model.dtype=float32", f"data.paths=[{convs}]",
                "aux_layers=[1]", "max_seq_len=64", "shard_tokens=64", "val_fraction=0", "progress=false",
                f"out={out}"]
    capture = ["backend=vllm", "vllm.endpoints=[http://127.0.0.1:9]", f"vllm.spool_dir={spool}"]
    cfg = PrecomputeConfig(model=ModelConfig(path=str(target), dtype="float32", fetch=None),
                           data=DataConfig(paths=[str(convs)]), out=str(out), aux_layers=[1], max_seq_len=64,
                           shard_tokens=64, val_fraction=0.0, progress=False)
    _captures_of(cfg, spool)

    def cli(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mtp_train.cli.precompute", *args], capture_output=True,
                              text=True, cwd=ROOT)

    made = cli(settings + capture)
    assert made.returncode == 0, made.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["provenance"]["settings"]["backend"] == "vllm"
    before = _files(out)

    again = cli(settings + capture)
    assert again.returncode == 0, again.stderr[-3000:]
    said = [line for line in again.stdout.splitlines() if line.startswith("mtp-precompute: ")]
    assert len(said) == 1 and "already holds this precompute" in said[0] and "backend=vllm" in said[0], again.stdout
    assert "nothing to do" in said[0] and "captured by vLLM" not in again.stdout
    assert _files(out) == before

    engine = cli(settings + ["model.device=cpu"])
    errors = [line for line in engine.stderr.splitlines() if line.startswith("mtp-precompute: error: ")]
    assert engine.returncode == 2 and len(errors) == 1, engine.stderr[-3000:]
    assert f"{out} holds a finished precompute of other settings (backend vllm, this run engine)" in errors[0]
    assert "overwrite=true" in errors[0] and "Traceback" not in engine.stderr
    assert _files(out) == before

