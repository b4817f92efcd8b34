"""Exports: every layout round-trips (export → load back → the same features and logits), the files carry the
layout's names and config keys, and heads that do not fit a layout are refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mtp_train.config import HEAD_TYPES, HeadConfig
from mtp_train.config.export import check_import
from mtp_train.export import (
    LAYOUTS,
    LayoutError,
    export_formats,
    export_head,
    import_layouts,
    load_export,
    unmatched_formats,
    verify_round_trip,
)
from mtp_train.export.importer import reader_of
from mtp_train.heads import build_head, load_head, save_head
from mtp_train.layers import AttentionMetadata
from mtp_train.models import ModelConfigError
from tests.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [("native", "mtp"), ("native", "eagle1"), ("vllm-eagle", "eagle1"), ("sglang-eagle", "eagle1"),
         ("deepseek-mtp", "mtp"), ("qwen3-next-mtp", "mtp")]
TOL = {"rtol": 1e-5, "atol": 1e-6}  # MKL's results may depend on memory alignment; the tensors are bit-equal


def _trained_like(tiny_checkpoints, name, type_, tmp_path, **cfg):
    """A head with weights away from their init (norms ≠ 1), saved as mtp-train saves it."""
    torch.manual_seed(0)
    head = build_head(HeadConfig.of(type=type_, **cfg), tiny_checkpoints[name][0])
    with torch.no_grad():
        for n, p in head.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if n.endswith("norm.weight") else 0.02))
    return save_head(head, tmp_path / "head")


def _features_and_logits(head, rows=9):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(rows, head.args.hidden_size, generator=g)
    tokens = torch.randint(0, head.args.vocab_size, (rows,), generator=g)
    with torch.no_grad():
        out = head(hidden, tokens, AttentionMetadata.build([4, 5]), from_target=True, logits_indices=torch.arange(rows))
    return out.hidden, out.logits


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize(("fmt", "type_"), CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_export_round_trip_gives_identical_features_and_logits(tiny_checkpoints, tmp_path, name, fmt, type_):
    target = tiny_checkpoints[name][0]
    head_dir = _trained_like(tiny_checkpoints, name, type_, tmp_path)
    out = export_head(head_dir, target, fmt, tmp_path / fmt)
    a, b = load_head(head_dir, target), load_export(out, target)
    for x, y in zip(_features_and_logits(a), _features_and_logits(b)):
        torch.testing.assert_close(y, x, **TOL)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_layout_names_and_config_keys(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["llama"][0]
    n_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]

    def names(folder):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return set(f.keys())

    mtp = _trained_like(tiny_checkpoints, "llama", "mtp", tmp_path / "m")
    ds = names(export_head(mtp, target, "deepseek-mtp", tmp_path / "ds"))
    p = f"model.layers.{n_layers}."
    assert {f"{p}enorm.weight", f"{p}hnorm.weight", f"{p}eh_proj.weight", f"{p}shared_head.norm.weight",
            f"{p}shared_head.head.weight", f"{p}embed_tokens.weight", f"{p}self_attn.q_proj.weight",
            f"{p}self_attn.k_proj.weight", f"{p}mlp.gate_proj.weight", f"{p}input_layernorm.weight"} <= ds
    assert not any("qkv_proj" in n or "gate_up" in n for n in ds)
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    qn_dir = export_head(mtp, target, "qwen3-next-mtp", tmp_path / "qn")
    qn = names(qn_dir)
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.v_proj.weight", "mtp.layers.0.mlp.up_proj.weight"} <= qn
    # Qwen3-Next norms are x·(1 + w): the stored weight is ours minus one.
    ours = load_head(mtp, target).norm.weight
    with safe_open(str(qn_dir / "model.safetensors"), "pt") as f:
        torch.testing.assert_close(f.get_tensor("mtp.norm.weight") + 1, ours.detach())
    assert json.loads((qn_dir / "config.json").read_text())["attn_output_gate"] is False

    eagle = _trained_like(tiny_checkpoints, "llama", "eagle1", tmp_path / "e")
    v = names(export_head(eagle, target, "vllm-eagle", tmp_path / "v"))
    assert "fc.weight" in v and "fc.bias" not in v and "layers.0.input_layernorm.weight" not in v
    assert not any(n.startswith("model.") or "lm_head" in n or "embed_tokens" in n for n in v)
    assert json.loads((tmp_path / "v" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    s = names(export_head(eagle, target, "sglang-eagle", tmp_path / "s"))
    assert s == v | {"fc.bias"}
    assert json.loads((tmp_path / "s" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]


@pytest.mark.parametrize(("fmt", "type_", "cfg", "match"), [
    ("vllm-eagle", "mtp", {}, "takes eagle1 heads"),
    ("deepseek-mtp", "eagle1", {}, "takes mtp heads"),
    ("deepseek-mtp", "mtp", {"final_norm": False}, "final_norm=False"),
    ("qwen3-next-mtp", "mtp", {"fc_bias": True}, "fc_bias=True"),
    ("vllm-eagle", "eagle1", {"fc_bias": True}, "fc_bias=True"),
    ("sglang-eagle", "eagle1", {"input_norm": True}, "input_layernorm"),
    ("speculators", "mtp", {}, "takes eagle3 heads"),
    ("sglang-eagle3", "eagle1", {}, "takes eagle3 heads"),
    ("tensorrt", "mtp", {}, "unknown export format"),
])
def test_heads_that_do_not_fit_are_refused(tiny_checkpoints, tmp_path, fmt, type_, cfg, match):
    head_dir = _trained_like(tiny_checkpoints, "llama", type_, tmp_path, **cfg)
    with pytest.raises(LayoutError, match=match):
        export_head(head_dir, tiny_checkpoints["llama"][0], fmt, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_draft_vocabulary_head_exports_with_the_full_vocabulary(tiny_checkpoints, tmp_path):
    """Layouts have no draft vocabulary: the export drafts over the whole vocabulary, with the same features,
    and its logits restricted to the draft vocabulary are the head's."""
    target = tiny_checkpoints["llama"][0]
    head_dir = _trained_like(tiny_checkpoints, "llama", "mtp", tmp_path, draft_vocab_size=40)
    a = load_head(head_dir, target)
    a.set_draft_vocab(torch.arange(0, 200, 5))
    save_head(a, head_dir)
    b = load_export(export_head(head_dir, target, "deepseek-mtp", tmp_path / "ds"), target)
    (fa, la), (fb, lb) = _features_and_logits(a), _features_and_logits(b)
    torch.testing.assert_close(fb, fa, **TOL)
    assert lb.shape[-1] == a.args.vocab_size and la.shape[-1] == 40
    torch.testing.assert_close(lb[:, a.draft_vocab], la, **TOL)


def test_a_tampered_export_is_refused_naming_the_key(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_checkpoints["llama"][0]
    out = export_head(_trained_like(tiny_checkpoints, "llama", "mtp", tmp_path), target, "qwen3-next-mtp",
                      tmp_path / "qn")
    tensors = load_file(str(out / "model.safetensors"))
    tensors.pop("mtp.fc.weight")
    save_file(tensors, str(out / "model.safetensors"))
    # The export's config records its weights' sha256: a rewritten file is refused by name at once ...
    with pytest.raises(ModelConfigError, match=r"model.safetensors has \d+ bytes, .*config.json records"):
        load_export(out, target)
    # ... and without that record and the config's own checksum (edited by hand), by the key that does not fit.
    cfg = json.loads((out / "config.json").read_text())
    del cfg["mtp_train"]["files"], cfg["mtp_train"]["config_sha256"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="mtp.fc.weight: missing"):
        load_export(out, target)


@pytest.mark.parametrize("fmt", ["native", "speculators", "sglang-eagle3"])
def test_eagle3_export_round_trip_gives_identical_features_and_logits(tmp_path, fmt):
    target = tmp_path / "target"
    make_tiny_checkpoint("llama", target, num_hidden_layers=5)  # serving engines capture hidden_states[1..L-1]
    head_dir = _trained_like({"llama": (target,)}, "llama", "eagle3", tmp_path, draft_vocab_size=64,
                             aux_layers=[1, 2, 4])
    out = export_head(head_dir, target, fmt, tmp_path / fmt)
    a, b = load_head(head_dir, target), load_export(out, target)
    assert torch.equal(a.draft_vocab, b.draft_vocab) and b.cfg.aux_layers == a.cfg.aux_layers
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 3 * a.args.hidden_size, generator=g)  # the three aux layers, concatenated
    tokens = torch.randint(0, a.args.vocab_size, (9,), generator=g)
    with torch.no_grad():
        x, y = (h(hidden, tokens, AttentionMetadata.build([4, 5]), from_target=True, logits_indices=torch.arange(9))
                for h in (a, b))
    torch.testing.assert_close(y.hidden, x.hidden, **TOL)
    torch.testing.assert_close(y.logits, x.logits, **TOL)


def test_each_format_is_named_by_the_specs_of_the_head_types_it_takes():
    assert unmatched_formats() == ([], [])
    assert {f for t in HEAD_TYPES.values() for f in t.spec.formats} == set(export_formats())
    for fmt, layout in LAYOUTS.items():
        assert layout.head_types == tuple(n for n, t in HEAD_TYPES.items() if fmt in t.spec.formats) != ()


def test_the_layouts_come_from_the_head_types_with_their_readers_and_serving_engines():
    """LAYOUTS is filled from each type's `HeadType.layouts` (its folder), the spec's formats derive from them, and
    `import_from` takes exactly the layouts with a reader; each type names the vLLM drafter its layout loads as
    (`make check-vllm` ran these) without anything outside its folder spelling it."""
    for name, t in HEAD_TYPES.items():
        assert t.formats == t.spec.formats == ("native", *(lo.name for lo in t.layouts))
        assert all(LAYOUTS[lo.name] is lo and lo.head_types == (name,) for lo in t.layouts)
        assert all(type(lo).__module__ == "mtp_train.export.layouts" for lo in t.layouts)
    assert import_layouts() == ("dflash", "speculators-dflash", "dspark", "speculators-peagle")
    served = {name: t.serving("vllm") for name, t in HEAD_TYPES.items()}
    assert served == {"dflash": ("dflash", {"method": "dflash"}), "dspark": ("dspark", {"method": "dspark"}),
                      "eagle1": ("vllm-eagle", {"method": "eagle"}), "eagle3": ("speculators", {"method": "eagle3"}),
                      "mtp": None,
                      "peagle": ("speculators-peagle", {"method": "eagle3", "parallel_drafting": True})}
    assert HEAD_TYPES.get("eagle3").serving("sglang") == ("sglang-eagle3", {"speculative_algorithm": "EAGLE3"})


def test_a_head_type_registered_later_brings_its_layouts():
    """A type registered after the registries were read (a plug-in added at run time) exports in its own layout:
    the export registry picks its layouts up; nothing else lists them."""
    import dataclasses

    from mtp_train.export.layouts import layout_named

    eagle1 = HEAD_TYPES.get("eagle1")
    mine = dataclasses.replace(eagle1.layouts[0], name="vllm-eagle-again")
    HEAD_TYPES.add(dataclasses.replace(eagle1, spec=dataclasses.replace(eagle1.spec, name="eagle1-again"),
                                       layouts=(mine,)))
    try:
        assert export_formats()[-1] == "vllm-eagle-again" and layout_named("vllm-eagle-again") is mine
        assert mine.head_types == ("eagle1-again",) and unmatched_formats() == ([], [])
        assert HEAD_TYPES.get("eagle1-again").serving("vllm") == ("vllm-eagle-again", {"method": "eagle"})
    finally:
        HEAD_TYPES.unregister("eagle1-again")
        LAYOUTS.unregister("vllm-eagle-again")
    assert "vllm-eagle-again" not in export_formats()


def test_import_from_is_checked_against_the_layouts_that_have_a_reader():
    check_import("dspark", "native", None, import_layouts())
    with pytest.raises(ValueError, match=r"import_from='speculators': choose one of dflash, speculators-dflash"):
        check_import("speculators", "native", None, import_layouts())  # a layout, but one nothing reads back
    with pytest.raises(ValueError, match="import_from=dflash writes a native head: drop format=dflash"):
        check_import("dflash", "dflash", None, import_layouts())
    with pytest.raises(ModelConfigError, match="no reader for that layout; choose one of dflash"):
        reader_of("vllm-eagle")


def test_sets_of_head_types_are_properties_of_the_types():
    """A family's head block and a foreign target take the types that say so, never a list of names."""
    from mtp_train.models.families import family_for_type
    from mtp_train.models.foreign import FOREIGN_HEAD_TYPES

    deepseek = family_for_type("deepseek_v3").head_types
    assert list(deepseek) == [n for n, t in HEAD_TYPES.items() if "target_mtp" in t.spec.inits] == ["mtp"]
    assert "mtp" in deepseek and "eagle1" not in deepseek and "nonesuch" not in deepseek and len(deepseek) == 1
    assert list(FOREIGN_HEAD_TYPES) == [n for n, t in HEAD_TYPES.items() if t.foreign_targets] == ["eagle3"]


def test_round_trip_check_reads_an_aux_mtp_head_through_its_aux_fc(tiny_checkpoints, tmp_path):
    """An mtp head with features=aux reads (rows, 3·H) at step 0: the check feeds that width, so a difference in
    aux_fc alone (which an (rows, H) input would skip) shows."""
    target = tiny_checkpoints["llama"][0]
    head_dir = _trained_like(tiny_checkpoints, "llama", "mtp", tmp_path / "a", features="aux", aux_layers=[1, 2, 3])
    head = load_head(head_dir, target)
    assert head.input_width == 3 * head.args.hidden_size
    assert verify_round_trip(head_dir, export_head(head_dir, target, "native", tmp_path / "native"), target) == 0.0
    with torch.no_grad():  # not a scale: hnorm would undo it
        head.aux_fc.weight.add_(torch.randn_like(head.aux_fc.weight) * 0.1)
    other = save_head(head, tmp_path / "other")
    assert verify_round_trip(head_dir, other, target) > 1e-3


def test_stitch_refuses_a_target_family_without_mtp_layers(tiny_checkpoints, tmp_path):
    """A Llama-family checkpoint has no place for a `model.layers.{L}.*` layer (its loader refuses such tensors), so
    `stitch=` into it is refused by name; the deepseek-mtp export on its own still works (tests/test_target_mtp.py
    stitches into DeepSeek-V3)."""
    from mtp_train.export import stitch_head

    head_dir = _trained_like(tiny_checkpoints, "llama", "mtp", tmp_path)
    with pytest.raises(LayoutError, match="stitch: a Llama-family target declares no MTP layers"):
        stitch_head(head_dir, tiny_checkpoints["llama"][0], tmp_path / "stitched")
    assert not (tmp_path / "stitched").exists()


def _trained_in(folder, target_name="tgt"):
    """A dflash head of a chat target in `folder/models/<target_name>`, saved where mtp-train run in `folder` with
    `model.path=models/<target_name> out=runs/t` saves it: runs/t/heads/step-1, its train_config.yaml beside it."""
    from omegaconf import OmegaConf

    from mtp_train.train.checkpoint import export_head as save_step
    from tests.conftest import compose_config, make_chat_target

    target = make_chat_target(folder / "models" / target_name)
    torch.manual_seed(0)
    head = build_head(HeadConfig.of(type="dflash", block_size=4, mask_token_id=1, aux_layers=[1]), target,
                      dtype="float32")
    run = compose_config("train", [f"model.path=models/{target_name}", "out=runs/t", "head=dflash"])
    return save_step(head, folder / "runs" / "t", 1, OmegaConf.to_yaml(run), target_fingerprint=None), target


def test_an_export_names_the_target_the_head_records_from_any_folder(tmp_path, monkeypatch, capsys):
    """Run from another folder without model.path, mtp-export reads the head's target from its train_config.yaml
    (model.path, relative to where mtp-train ran), says so, and names it resolved as the speculators verifier;
    model.path given is resolved too; verifier_name, when given, is the name written instead."""
    from mtp_train.cli.export import export_main
    from tests.conftest import compose_config

    a, b = tmp_path / "a", tmp_path / "b"
    head_dir, target = _trained_in(a)
    b.mkdir()

    def verifier(overrides, out):
        export_main(compose_config("export", [f"head_ckpt={head_dir}", "format=speculators-dflash",
                                              "model.device=cpu", f"out={out}", *overrides]))
        return json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]

    monkeypatch.chdir(b)
    capsys.readouterr()
    assert verifier([], tmp_path / "e1") == str(target.resolve())
    said = capsys.readouterr().out
    assert f"mtp-export: target {target.resolve()}, as the head records it ({head_dir}/train_config.yaml" in said
    assert not (b / "models").exists()  # nothing fetched into the working folder
    monkeypatch.chdir(a)
    assert verifier(["model.path=models/tgt"], tmp_path / "e2") == str(target.resolve())
    assert verifier(["verifier_name=org/served-id"], tmp_path / "e3") == "org/served-id"
    native = tmp_path / "native"
    export_main(compose_config("export", [f"head_ckpt={head_dir}", f"out={native}", "model.device=cpu"]))
    monkeypatch.chdir(b)  # a native export records its target itself: it exports from anywhere too
    assert verifier([f"head_ckpt={native}"], tmp_path / "e4") == str(target.resolve())


def test_a_recorded_target_that_cannot_be_placed_or_has_moved_is_refused_naming_the_record(tmp_path, monkeypatch):
    """A head copied out of its run no longer tells where a relative model.path started; a target moved away is
    named with the file that records it. Both ask for model.path."""
    import shutil

    from mtp_train.cli.export import export_main
    from tests.conftest import compose_config

    head_dir, target = _trained_in(tmp_path / "a")
    copied = shutil.copytree(head_dir, tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelConfigError, match=r"records model.path=models/tgt, relative to the folder mtp-train ran "
                                               r"in.*pass model.path="):
        export_main(compose_config("export", [f"head_ckpt={copied}", f"out={tmp_path / 'x1'}"]))
    target.rename(tmp_path / "moved")
    with pytest.raises(ModelConfigError, match=r"the head's target .*/a/models/tgt, as .*train_config.yaml "
                                               r"\(model.path=models/tgt, from .*/a, where mtp-train ran\) records "
                                               r"it: .*config.json does not exist; pass model.path="):
        export_main(compose_config("export", [f"head_ckpt={head_dir}", f"out={tmp_path / 'x2'}"]))
    assert not (tmp_path / "x1").exists() and not (tmp_path / "x2").exists()
