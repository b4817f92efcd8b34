"""Targets no family here implements (`models/foreign.py`), without vLLM: the shapes and the two tensors a head reads
(by the usual names, tied or not), an eagle3 head over one exported for vLLM, and every refusal of what would run
one (our engine, online / hybrid training, our validation, other head types, a vLLM eval of a grid).

The target is a tiny random IBM Granite (`checks/check_vllm_foreign.make_foreign_target`): vLLM serves it with
EAGLE-3 support and no family here runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checks.check_vllm_foreign import make_foreign_target, shifted_head, verdict
from mtp_train.capture.vllm_generate import count_delta, output_ids
from mtp_train.config import ConfigError, EvalConfig, HeadConfig, TrainConfig
from mtp_train.config.model import ModelConfig
from mtp_train.eval.vllm import VllmEvalError, add_counts, check_settings, row
from mtp_train.heads import FrozenTargetParts, build_head
from mtp_train.heads.checkpoint import save_head
from mtp_train.models.config import ModelConfigError
from mtp_train.models.foreign import EMBED_NAMES, embedding_names, foreign_dir, head_target_args
from mtp_train.precompute.vllm_backend import final_norm
from mtp_train.precompute.writer import PrecomputeError
from mtp_train.train.foreign import check_foreign_target
from tests.conftest import compose_config, make_chat_target


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("tok") / "llama")  # a small ChatML tokenizer (and a Llama)


@pytest.fixture(scope="module")
def granite(tmp_path_factory, tokenizer_dir) -> Path:
    return make_foreign_target(tmp_path_factory.mktemp("granite") / "untied", tokenizer_dir, hidden_size=32,
                               head_dim=8)


@pytest.fixture(scope="module")
def granite_tied(tmp_path_factory, tokenizer_dir) -> Path:
    return make_foreign_target(tmp_path_factory.mktemp("granite") / "tied", tokenizer_dir, hidden_size=32, head_dim=8,
                               tie=True)


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def test_a_foreign_target_is_read_for_its_shapes_as_a_llama_block_would_take_them(granite, tokenizer_dir):
    cfg = json.loads((granite / "config.json").read_text())
    assert foreign_dir(granite) and not foreign_dir(tokenizer_dir)
    args = head_target_args(granite)
    assert args.model_type == "llama" and args.raw["model_type"] == "granite"  # the head block's family, the type kept
    assert (args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim, args.vocab_size) == (
        32, 8, 4, 2, 8, cfg["vocab_size"])
    assert args.intermediate_size == 64 and args.rms_norm_eps == 1e-5 and args.eos_token_ids == [cfg["eos_token_id"]]
    assert not (args.qkv_bias or args.o_bias or args.qk_norm) and args.sliding_window is None
    assert head_target_args(tokenizer_dir).model_type == "llama"  # a registered family: its own parse


def test_only_the_embedding_and_lm_head_are_read_untied_and_tied(granite, granite_tied, monkeypatch):
    import mtp_train.heads.frozen as frozen_mod

    read: list[str] = []
    iter_tensors = frozen_mod.iter_tensors

    def spy(files):
        for n, t in iter_tensors(files):
            read.append(n)
            yield n, t

    monkeypatch.setattr(frozen_mod, "iter_tensors", spy)
    ckpt = _checkpoint(granite)
    parts = FrozenTargetParts.from_pretrained(granite, dtype="float32")
    assert read == ["model.embed_tokens.weight", "lm_head.weight"]  # never a layer of the family
    assert not parts.tied
    torch.testing.assert_close(parts.embed, ckpt["model.embed_tokens.weight"], rtol=0, atol=0)
    torch.testing.assert_close(parts.lm_head, ckpt["lm_head.weight"], rtol=0, atol=0)
    assert "lm_head.weight" not in _checkpoint(granite_tied)  # a tied checkpoint stores the embedding alone
    tied = FrozenTargetParts.from_pretrained(granite_tied, dtype="float32")
    assert tied.tied and tied.lm_head is tied.embed and read[2:] == ["model.embed_tokens.weight"]
    torch.testing.assert_close(tied.embed, _checkpoint(granite_tied)["model.embed_tokens.weight"], rtol=0, atol=0)


def test_the_usual_names_are_tried_in_order_and_a_missing_one_is_named(tmp_path):
    mm = {"model.language_model.embed_tokens.weight": 0, "language_model.lm_head.weight": 0}
    assert embedding_names(mm, tied=False, where="x") == ("model.language_model.embed_tokens.weight",
                                                          "language_model.lm_head.weight")
    gpt = {"transformer.wte.weight": 0, "lm_head.weight": 0, "model.embed_tokens.weight": 0}
    assert embedding_names(gpt, tied=False, where="x")[0] == "model.embed_tokens.weight"  # the first pattern wins
    assert embedding_names({"transformer.wte.weight": 0}, tied=True, where="x") == ("transformer.wte.weight",) * 2
    with pytest.raises(ModelConfigError, match=r"lacks an lm_head \(tried lm_head.weight, .*tie_word_embeddings"):
        embedding_names({"model.embed_tokens.weight": 0}, tied=False, where="x")
    with pytest.raises(ModelConfigError, match="lacks an input embedding") as e:
        embedding_names({"lm_head.weight": 0}, tied=False, where="x")
    assert all(n in str(e.value) for n in EMBED_NAMES)


def test_an_lm_head_under_another_usual_name_is_read(granite, tmp_path):
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in granite.iterdir():
        if f.name != "model.safetensors":
            (moved / f.name).write_bytes(f.read_bytes())
    ckpt = _checkpoint(granite)
    ckpt["output.weight"] = ckpt.pop("lm_head.weight")
    save_file(ckpt, str(moved / "model.safetensors"))
    parts = FrozenTargetParts.from_pretrained(moved, dtype="float32")
    torch.testing.assert_close(parts.lm_head, ckpt["output.weight"], rtol=0, atol=0)


def test_the_capture_reads_the_final_norm_by_name_and_refuses_a_layernorm(granite, tmp_path):
    args = head_target_args(granite)
    norm = final_norm(granite, args, torch.float32)
    torch.testing.assert_close(norm.weight.detach(), _checkpoint(granite)["model.norm.weight"], rtol=0, atol=0)
    ln = tmp_path / "ln"
    ln.mkdir()
    (ln / "config.json").write_text((granite / "config.json").read_text())
    ckpt = _checkpoint(granite)
    ckpt["model.norm.bias"] = torch.zeros(32)
    save_file(ckpt, str(ln / "model.safetensors"))
    with pytest.raises(PrecomputeError, match=r"final norm has a bias \(model.norm.bias, a LayerNorm\)"):
        final_norm(ln, args, torch.float32)


def test_an_eagle3_head_over_a_foreign_target_exports_for_vllm(granite, tmp_path):
    from mtp_train.export import export_head, verify_round_trip

    head = build_head(HeadConfig(type="eagle3", aux_layers=[2, 4, 5], draft_vocab_size=64), granite, dtype="float32")
    save_head(head, tmp_path / "head")
    assert json.loads((tmp_path / "head" / "config.json").read_text())["target_model_type"] == "granite"
    out = export_head(tmp_path / "head", granite, "speculators", tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["model_type"] == "llama"  # the draft layer vLLM builds
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["GraniteForCausalLM"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert verify_round_trip(tmp_path / "head", out, granite) == 0.0


def test_the_checks_control_head_reads_later_layers_with_the_same_weights(granite, tmp_path):
    """check-vllm-foreign's control: the same head, its aux layer ids shifted, loads (its digest renewed) and
    exports for vLLM naming the shifted layers, with the trained head's exported weights unchanged."""
    from mtp_train.export import export_head
    from mtp_train.heads.checkpoint import load_head

    head = build_head(HeadConfig(type="eagle3", aux_layers=[2, 4, 5], draft_vocab_size=64), granite, dtype="float32")
    save_head(head, tmp_path / "head")
    shifted = shifted_head(tmp_path / "head", tmp_path / "shifted", 1)
    assert list(load_head(shifted, granite).cfg.aux_layers) == [3, 5, 6]
    outs = [export_head(d, granite, "speculators", tmp_path / f"export-{d.name}") for d in (tmp_path / "head", shifted)]
    assert [json.loads((o / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] for o in outs] == [
        [2, 4, 5], [3, 5, 6]]
    a, b = (_checkpoint(o) for o in outs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_our_engine_refuses_a_foreign_target_naming_the_vllm_route(granite):
    from mtp_train.models import load_model

    with pytest.raises(ModelConfigError, match=r"model_type 'granite'.*not supported.*mtp-precompute backend=vllm"):
        load_model(granite, dtype="float32")


def _train_cfg(target: Path, *extra: str) -> TrainConfig:
    from mtp_train.config import typed

    return typed(compose_config("train", [f"model.path={target}", "model.fetch=null", "head=eagle3",
                                          "spec_eval.prompts=[]", *extra]), TrainConfig)


@pytest.mark.parametrize(("extra", "said"), [
    (("data.source=online", "data.paths=[c.jsonl]"), "data.source=online (hidden states from our engine)"),
    (("data.source=hybrid", "data.paths=[c.jsonl]"), "data.source=hybrid (hidden states from our engine)"),
    (("spec_eval.prompts=[demo-heldout]",), "spec_eval.prompts (validation by our engine"),
    (("head=mtp",), "head=mtp (a head over the family's own layers; such a target takes head=eagle3)"),
])
def test_training_refuses_what_would_run_a_foreign_target(granite, extra, said):
    with pytest.raises(ConfigError) as e:
        check_foreign_target(_train_cfg(granite, *extra))
    msg = str(e.value)
    assert said in msg and "'granite' (GraniteForCausalLM)" in msg and "mtp-eval backend=vllm" in msg
    assert "\n" not in msg


def test_training_on_an_offline_folder_and_registered_targets_pass(granite, tokenizer_dir):
    check_foreign_target(_train_cfg(granite, "data.dir=pc"))  # what the vLLM route trains with
    check_foreign_target(_train_cfg(tokenizer_dir, "data.source=online", "data.paths=[c.jsonl]"))


def _eval_cfg(**kw) -> EvalConfig:
    return EvalConfig(model=ModelConfig(path="t"), head_ckpt="h", backend="vllm", **kw)


def test_a_vllm_eval_measures_one_point_of_the_head():
    point = check_settings(_eval_cfg(k=3, temperature=0.0))
    assert (point.method, point.k, point.temperature) == ("head", 3, 0.0)
    for kw, said in (({"k": [2, 3]}, "one point"), ({"temperature": [0, 1]}, "one point"),
                     ({"method": "ngram"}, "method=head head_ckpt=DIR"), ({"tree": "3x2x4"}, "tree=3x2x4"),
                     ({"draft_width": 2}, "draft_width=2"), ({"draft_threshold": 0.5}, "draft_threshold=0.5")):
        with pytest.raises(VllmEvalError, match=said):
            check_settings(_eval_cfg(**kw))
    with pytest.raises(VllmEvalError, match="head_ckpt=DIR"):
        check_settings(EvalConfig(model=ModelConfig(path="t"), backend="vllm"))
    with pytest.raises(ConfigError, match="backend='vlm'"):
        EvalConfig(backend="vlm")


def test_vllm_counters_become_mtp_evals_fields():
    a = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted": 12, "accepted_per_pos": [6, 4, 2]}
    b = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted": 3, "accepted_per_pos": [2, 1]}
    total = add_counts(a, b)
    assert total == {"num_drafts": 14, "num_draft_tokens": 42, "num_accepted": 15, "accepted_per_pos": [8, 5, 2]}
    assert count_delta(total, a) == {**b, "accepted_per_pos": [2, 1, 0]}
    assert add_counts(None, b) == b and count_delta(a, None) == a
    point = check_settings(_eval_cfg(k=3))
    r = row("demo", point, prompts=2, tokens=40, seconds=4.0, counts=a, version="0.x")
    assert (r["tau"], r["acceptance_rate"], r["mean_draft_len"]) == (pytest.approx(2.2), pytest.approx(0.4), 3.0)
    assert r["per_position"] == pytest.approx([0.6, 0.4, 0.2]) and r["tokens_per_s"] == 10.0
    assert (r["num_drafts"], r["num_accepted"], r["backend"], r["label"]) == (10, 12, "vllm", point.label)
    assert "tau" not in row("demo", point, 2, 40, 4.0, None, None)  # no counters: no speculative fields


def test_an_answer_keeps_the_stop_token_it_ended_on():
    assert output_ids([5, 6], "stop", 2) == [5, 6, 2]  # vLLM left the stop id out
    assert output_ids([5, 6, 2], "stop", 2) == [5, 6, 2]
    assert output_ids([5, 6], "length", None) == [5, 6]
    assert output_ids([5, 6, 7], "stop", None) == [5, 6, 7]  # the EOS: already in


def test_the_commands_refuse_a_foreign_target_in_one_line(granite, tmp_path):
    base = [sys.executable, "-m", "mtp_train.cli.eval", f"model.path={granite}", "model.fetch=null",
            f"head_ckpt={tmp_path}", f"out={tmp_path / 'ev'}", "prompts=[demo-heldout]", "limit=1"]
    for extra, said in (([], "backend=engine (our engine runs the target)"),
                        (["backend=vllm", f"vllm_python={tmp_path / 'none'}"], "vllm_python=")):
        r = subprocess.run(base + extra, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_regenerating_a_foreign_target_through_servers_reads_only_its_tokenizer_and_stop_ids(granite, tmp_path):
    """`mtp-regenerate generator=openai` on a target no family runs gets as far as the servers (here none answers):
    its stop ids come from config.json as a head reads it, not from a family's parse, which refuses a Granite."""
    from mtp_train.processes import free_port

    data = tmp_path / "convs.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "mtp_train.cli.regenerate", "generator=openai",
                        f"endpoints=[http://127.0.0.1:{port}]", f"model.path={granite}", "model.fetch=null",
                        "retries=0", f"data.paths=[{data}]", f"out={tmp_path / 'out.jsonl'}"], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    errors = [line for line in r.stderr.splitlines() if line.startswith("mtp-regenerate: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert f"http://127.0.0.1:{port} is unreachable" in errors[0] and "granite" not in errors[0]
    assert not (tmp_path / "out.jsonl").exists()


def test_a_python_without_vllm_is_one_line_and_stops_nothing_else(granite, tmp_path, monkeypatch):
    """The driver's protocol up to vLLM's import: the head exported, the staged side started from `vllm_python`
    (this environment's python, which has no vLLM), its failure read back as one line naming the environment."""
    from mtp_train.data.prompts import load_prompt_sets
    from mtp_train.eval.vllm import evaluate_vllm

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    head = build_head(HeadConfig(type="eagle3", aux_layers=[2, 4, 5], draft_vocab_size=64), granite, dtype="float32")
    save_head(head, tmp_path / "head")
    ec = EvalConfig(model=ModelConfig(path=str(granite), dtype="float32", fetch=None), head_ckpt=str(tmp_path / "head"),
                    backend="vllm", vllm_python=sys.executable, k=2, max_new_tokens=4, out=str(tmp_path / "ev"))
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # prompt-set paths are relative to the checkout
    (tmp_path / "ev").mkdir()
    with pytest.raises(VllmEvalError, match=r"vllm_python cannot import vLLM \(ModuleNotFoundError") as e:
        evaluate_vllm(ec, load_prompt_sets(["demo-heldout"], 1), environ=dict(os.environ))
    assert "\n" not in str(e.value)
    assert (tmp_path / "ev" / "export" / "model.safetensors").is_file()  # exported before vLLM started
    assert "No module named 'vllm'" in (tmp_path / "ev" / "vllm-eval.log").read_text()


def test_the_checks_verdict_fails_on_tau_and_reports_a_control_that_cannot_show_the_numbering():
    """vLLM's measured rows (τ 1.610 for the head, 1.508 shifted): the check passes and says the numbering is not
    shown; a head under τ 1.3, or no drafts, fails it."""
    head = {"tau": 1.610, "num_drafts": 236}
    bad, unshown = verdict(head, {"tau": 1.508, "num_drafts": 252})
    assert bad == [] and len(unshown) == 1 and "cannot show the layer numbering" in unshown[0]
    assert verdict(head, {"tau": 1.2, "num_drafts": 250}) == ([], [])
    bad, _ = verdict({"tau": 1.2, "num_drafts": 236}, {"tau": 1.0, "num_drafts": 250})
    assert bad == ["the head's τ 1.200 < 1.3"]
    assert "vLLM counted no drafts" in verdict({"tau": None, "num_drafts": 0}, {"tau": 1.0, "num_drafts": 3})[0]
