"""speculators' DFlash layout (`format=speculators-dflash`): the round trip with and without a draft vocabulary, the
names and config vLLM's speculators adapter reads, and the import of such a folder (`import_from=speculators-dflash`)
with its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mtp_train.cli.export import export_main
from mtp_train.config import HeadConfig
from mtp_train.export import LayoutError, export_head, load_export, verify_round_trip
from mtp_train.export.importer import import_drafter
from mtp_train.head_types.dflash.head import DFlashHead
from mtp_train.head_types.dflash.layouts import import_dflash
from mtp_train.heads import build_head, save_head
from mtp_train.models import ModelConfigError
from tests.conftest import compose_config, make_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")


def _head(path, vocab: int = 0, **kw) -> DFlashHead:
    """A dflash head with perturbed weights (so a wrong map shows) and, with `vocab`, a draft vocabulary of
    that many scattered target ids."""
    torch.manual_seed(0)
    head = build_head(HeadConfig.of(type="dflash", draft_vocab_size=vocab, **kw), path, dtype="float32")
    assert isinstance(head, DFlashHead)
    if vocab:
        head.set_draft_vocab(torch.randperm(head.args.vocab_size)[:vocab])
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return head


def _foreign(folder):
    """The folder as speculators writes it: no block of ours in config.json."""
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["mtp_train"]
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg


@pytest.mark.parametrize("vocab", [0, 40])
def test_round_trip_gives_identical_blocks(tiny_checkpoints, tmp_path, vocab):
    target = tiny_checkpoints["qwen3"][0]
    head = _head(target, vocab, block_size=4, layers=2, mask_token_id=7)
    head_dir = save_head(head, tmp_path / "head")
    out = export_head(head_dir, target, "speculators-dflash", tmp_path / "spec")
    assert verify_round_trip(head_dir, out, target) == 0.0
    back = load_export(out, target)
    assert back.block_size == 4 and back.mask_token_id == 7 and back.cfg.aux_layers == head.cfg.aux_layers
    if vocab:
        assert torch.equal(back.draft_vocab, head.draft_vocab)
    else:
        assert back.draft_vocab is None


def test_names_and_config_are_what_vllms_speculators_adapter_reads(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["llama"][0]
    head = _head(target, 40, block_size=6, layers=2, mask_token_id=5)
    head_dir = save_head(head, tmp_path / "head")
    out = export_head(head_dir, target, "speculators-dflash", tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 6 and cfg["mask_token_id"] == 5
    assert cfg["draft_vocab_size"] == 40 and cfg["target_hidden_size"] == head.args.hidden_size
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2
    assert "dflash_config" not in layer and "architectures" not in layer
    # vLLM's update_dflash: target_layer_ids = ids - 1 (z-lab's numbering) and causal = not sliding_window_non_causal.
    assert [i - 1 for i in cfg["aux_hidden_state_layer_ids"]] == [j - 1 for j in head.aux_layers]
    assert cfg["sliding_window_non_causal"] is True and cfg["sample_from_anchor"] is False
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight"} <= tensors.keys()
    assert not any("embed" in k for k in tensors)
    torch.testing.assert_close(tensors["lm_head.weight"], head.lm_head_weight())  # the target's rows, in order
    assert torch.equal(tensors["d2t"] + torch.arange(40), head.draft_vocab)
    assert int(tensors["t2d"].sum()) == 40 and bool(tensors["t2d"][head.draft_vocab].all())
    # z-lab's layout has no draft vocabulary: refused, naming the layout that carries one.
    with pytest.raises(LayoutError, match="export format=speculators-dflash"):
        export_head(head_dir, target, "dflash", tmp_path / "zlab")


def test_a_speculators_folder_is_imported_and_a_trained_lm_head_refused(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["qwen3"][0]
    head = _head(target, 40, block_size=5, layers=1, mask_token_id=9)
    head_dir = save_head(head, tmp_path / "head")
    out = export_head(head_dir, target, "speculators-dflash", tmp_path / "spec")
    _foreign(out)
    got = import_drafter("speculators-dflash", out, target, dtype=torch.float32)
    assert (got.cfg.settings.layers, got.block_size, got.mask_token_id) == (1, 5, 9)
    assert torch.equal(got.draft_vocab, head.draft_vocab)
    x = torch.randn(6, head.input_width)
    ids = torch.randint(0, head.args.vocab_size, (6,))
    with torch.no_grad():
        torch.testing.assert_close(got.probe_features(x, ids), head.eval().probe_features(x, ids))
    with pytest.raises(ModelConfigError, match="this folder is read with import_from=speculators-dflash"):
        import_dflash(out, target)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 1.1
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelConfigError, match="lm_head.weight is not the target's rows"):
        import_drafter("speculators-dflash", out, target)
    del tensors["lm_head.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelConfigError, match=r"needs lm_head.weight, d2t and t2d together"):
        import_drafter("speculators-dflash", out, target)


def test_mtp_export_imports_a_speculators_folder_and_refuses_a_bad_config(tmp_path):
    target = make_chat_target(tmp_path / "target")
    head = _head(target, block_size=4, mask_token_id=1, aux_layers=[1])
    head_dir = save_head(head, tmp_path / "head")
    spec = export_head(head_dir, target, "speculators-dflash", tmp_path / "spec")
    cfg = _foreign(spec)
    base = [f"model.path={target}", "model.device=cpu", f"head_ckpt={spec}", "import_from=speculators-dflash"]
    res = export_main(compose_config("export", [*base, f"out={tmp_path / 'imported'}"]))
    assert res["max_abs_diff"] == 0.0 and verify_round_trip(head_dir, tmp_path / "imported", target) == 0.0
    del cfg["aux_hidden_state_layer_ids"]
    (spec / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"spec/config.json: a speculators DFlash config.json needs "
                                               r"aux_hidden_state_layer_ids"):
        export_main(compose_config("export", [*base, f"out={tmp_path / 'bad'}"]))
    assert not (tmp_path / "bad").exists()
