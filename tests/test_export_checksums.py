"""An export's config.json records a checksum of itself in every layout, as a native head's does: the layout's own
keys stay exactly the engines', the digest sits in the `mtp_train` block, and `load_export` refuses an edited or
damaged config.json naming the file."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from mtp_train.config import HeadConfig
from mtp_train.export import export_head, load_export
from mtp_train.heads import build_head, save_head
from mtp_train.models import ModelConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUTS = [("deepseek-mtp", "mtp"), ("qwen3-next-mtp", "mtp"), ("vllm-eagle", "eagle1"), ("sglang-eagle", "eagle1")]


def _export(tiny_checkpoints, tmp_path, fmt: str, type_: str):
    target = tiny_checkpoints["llama"][0]
    torch.manual_seed(0)
    head_dir = save_head(build_head(HeadConfig(type=type_), target), tmp_path / "head")
    return export_head(head_dir, target, fmt, tmp_path / fmt), target


def _edit(path, edit) -> None:
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize(("fmt", "type_"), LAYOUTS, ids=[f for f, _ in LAYOUTS])
def test_an_edited_export_config_is_refused_naming_the_file(tiny_checkpoints, tmp_path, fmt, type_):
    out, target = _export(tiny_checkpoints, tmp_path, fmt, type_)
    cfg = json.loads((out / "config.json").read_text())
    assert len(cfg["mtp_train"]["config_sha256"]) == 64 and "config_sha256" not in cfg  # no key of ours at the top
    load_export(out, target)  # as written: accepted

    # A layout key the engine reads and one of ours: each edit is caught by the checksum.
    layout_key = next(k for k in ("num_nextn_predict_layers", "attn_output_gate", "architectures") if k in cfg)
    for edit in (lambda c: c.update({layout_key: 2}), lambda c: c["mtp_train"]["head"].update(init="zeros")):
        _edit(out / "config.json", edit)
        with pytest.raises(ModelConfigError) as err:
            load_export(out, target)
        assert str(err.value).splitlines() == [
            f"{out / 'config.json'} does not match the mtp_train.config_sha256 it records: the file is damaged or "
            "was edited; export the head again"]
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    load_export(out, target)  # restored: accepted again


def test_an_export_without_a_checksum_loads_with_a_warning(tiny_checkpoints, tmp_path, caplog):
    """An export of an older version records no checksum: it is read, and the log says it is not verified."""
    out, target = _export(tiny_checkpoints, tmp_path, "deepseek-mtp", "mtp")
    _edit(out / "config.json", lambda c: c["mtp_train"].pop("config_sha256"))
    with caplog.at_level(logging.WARNING, logger="mtp_train.export.exporter"):
        load_export(out, target)
    assert "records no checksum of itself" in caplog.text


def test_an_export_block_that_is_not_one_is_refused(tiny_checkpoints, tmp_path):
    out, target = _export(tiny_checkpoints, tmp_path, "vllm-eagle", "eagle1")
    _edit(out / "config.json", lambda c: c.update(mtp_train=[1]))
    with pytest.raises(ModelConfigError, match=r"config\.json: `mtp_train` is list, not the export's block"):
        load_export(out, target)
