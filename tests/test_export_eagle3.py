"""EAGLE-3 exports (`format=speculators`, `format=sglang-eagle3`): exact-inverse name maps over hand-built
tensors with the eagle3 head's state-dict names, the draft vocabulary as d2t / t2d, each engine's aux-layer
numbering, the config fields the engines read, and the heads each layout refuses."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from mtp_train.export import LAYOUTS, LayoutError, check_fits, layout_tensors
from mtp_train.head_types.eagle3 import export as e3
from mtp_train.models.families import args_from_hf_config, family_of

L, H, HQ, HKV, D, FF, V, VD = 8, 32, 4, 2, 8, 48, 128, 16
TARGET = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": FF,
          "num_hidden_layers": L, "num_attention_heads": HQ, "num_key_value_heads": HKV, "vocab_size": V,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32", "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 1024}}
AUX = (2, L // 2, L - 3)  # EAGLE-3's low / mid / high in transformers' hidden_states[j] numbering


def _spec(target=TARGET, **over) -> e3.Eagle3Spec:
    args = args_from_hf_config(target)
    fields = {"args": args, "aux_layers": AUX, "draft_vocab_size": VD, "fusings": tuple(family_of(args).fusings)}
    return e3.Eagle3Spec(**{**fields, **over})


def _state(spec: e3.Eagle3Spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """The eagle3 head's state dict as the contract names it (fused q/k/v over 2H inputs, fused gate/up)."""
    g = torch.Generator().manual_seed(seed)
    a = spec.args

    def r(*shape):
        return torch.randn(*shape, generator=g)

    qkv_rows = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    s = {"fc.weight": r(H, 3 * H), "layers.0.input_layernorm.weight": r(H), "layers.0.hidden_norm.weight": r(H),
         "layers.0.self_attn.qkv_proj.weight": r(qkv_rows, 2 * H),
         "layers.0.self_attn.o_proj.weight": r(H, a.num_heads * a.head_dim),
         "layers.0.post_attention_layernorm.weight": r(H), "layers.0.mlp.gate_up_proj.weight": r(2 * FF, H),
         "layers.0.mlp.down_proj.weight": r(H, FF), "norm.weight": r(H), "lm_head.weight": r(VD, H),
         "draft_vocab": torch.randperm(V, generator=g)[:VD].sort().values}
    if a.qkv_bias:
        s["layers.0.self_attn.qkv_proj.bias"] = r(qkv_rows)
    if spec.aux_norm:  # EAGLE-3.1: one RMSNorm per aux layer
        s.update({f"aux_norm.{i}.weight": r(H) for i in range(len(spec.aux_layers))})
    if spec.fc_input_norm:  # speculators' norm_before_fc: one RMSNorm over the whole k·H input
        s["fc_input_norm.weight"] = r(len(spec.aux_layers) * H)
    return s


MAPS = {"speculators": (e3.to_speculators, e3.from_speculators, "layers.0."),
        "sglang-eagle3": (e3.to_sglang, e3.from_sglang, "midlayer.")}


@pytest.mark.parametrize("fmt", list(MAPS))
def test_name_maps_are_exact_inverses(fmt):
    to, frm, _ = MAPS[fmt]
    spec = _spec()
    state = _state(spec)
    back = frm(to(state, spec), spec)
    assert back.keys() == state.keys()
    for k in state:  # bit for bit, dtypes included (draft_vocab stays int64)
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k


@pytest.mark.parametrize("fmt", list(MAPS))
def test_layout_names_split_projections_and_vocabulary(fmt):
    to, _, p = MAPS[fmt]
    spec = _spec()
    state = _state(spec)
    out = to(state, spec)
    layer = ["input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert set(out) == {f"{p}{m}.weight" for m in layer} | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    # q/k/v split by rows of the fused projection, each still reading the 2H input [embedding ; hidden].
    qkv = state["layers.0.self_attn.qkv_proj.weight"]
    q, k, v = (out[f"{p}self_attn.{n}_proj.weight"] for n in "qkv")
    assert q.shape == (HQ * D, 2 * H) and k.shape == v.shape == (HKV * D, 2 * H)
    assert torch.equal(torch.cat([q, k, v]), qkv)
    assert torch.equal(torch.cat([out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"]]),
                       state["layers.0.mlp.gate_up_proj.weight"])
    # d2t: offsets that both engines add arange(V_d) back to (vLLM compute_logits, SGLang hot_token_id);
    # t2d: a bool mask over the TARGET vocabulary with exactly the draft tokens set.
    dv = state["draft_vocab"]
    assert out["d2t"].dtype == torch.int64 and torch.equal(out["d2t"] + torch.arange(VD), dv)
    assert out["t2d"].dtype == torch.bool and out["t2d"].shape == (V,) and int(out["t2d"].sum()) == VD
    assert torch.equal(out["t2d"].nonzero().flatten(), dv)


def test_aux_layer_numbering_of_each_engine():
    """Ours: transformers' hidden_states[j] (j = output of decoder layer j-1).
    vLLM captures `hidden_states + residual` before running layer k for k in its ids: the stream entering layer k,
    which is hidden_states[k] — the same number. SGLang turns its ids into `layers_to_capture = id + 1` and captures
    before that layer: its id k is hidden_states[k + 1], so it is written one less. (EAGLE-3's default
    (2, L//2, L-3) is vLLM's numbering; SpecForge, SGLang's trainer, defaults to (1, L//2-1, L-4).)"""
    spec = _spec()
    specs = e3.speculators_config(spec, TARGET)
    sgl = e3.sglang_config(spec, TARGET)
    assert specs["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert sgl["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert "eagle_aux_hidden_state_layer_ids" not in sgl  # vLLM would read a top-level one in its own numbering


def test_speculators_config_fields():
    spec = _spec()
    target = {**TARGET, "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}
    cfg = e3.speculators_config(spec, target)
    json.dumps(cfg)  # config.json material
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3DraftModel"]
    assert cfg["draft_vocab_size"] == VD and cfg["target_hidden_size"] == H
    # vLLM defaults norm_before_residual to True, speculators to False; ours keeps the un-normed residual.
    flags = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    assert {k: cfg.get(k) for k in flags} == dict.fromkeys(flags, False)
    layer = cfg["transformer_layer_config"]  # the one draft layer; vocab_size and context are the target's
    expected = {"model_type": "llama", "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": 1,
                "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D, "rms_norm_eps": 1e-5,
                "vocab_size": V, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                "attention_bias": False, "mlp_bias": False, "rope_theta": 500000.0, "hidden_act": "silu"}
    assert {k: layer.get(k) for k in expected} == expected
    assert layer["rope_scaling"] == TARGET["rope_scaling"]  # the target's rope, unchanged
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == e3.SPECULATIVE_TOKENS
    assert sc["verifier"] == {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
                              "architectures": ["LlamaForCausalLM"]}


def test_sglang_config_fields():
    cfg = e3.sglang_config(_spec(), TARGET)
    json.dumps(cfg)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is False  # tied, SGLang would use the embedding as lm_head
    assert cfg["draft_vocab_size"] == VD and cfg["vocab_size"] == V and cfg["num_hidden_layers"] == 1
    assert cfg["max_position_embeddings"] == TARGET["max_position_embeddings"]
    assert cfg["head_dim"] == D and cfg["rope_scaling"] == TARGET["rope_scaling"]
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True


def test_qkv_bias_gets_a_zero_o_proj_bias_for_vllm_and_is_refused_by_sglang():
    spec = _spec({**TARGET, "model_type": "qwen2"})  # Qwen2: q/k/v bias, none on o_proj
    assert spec.args.qkv_bias and not spec.args.o_bias
    state = _state(spec)
    out = e3.to_speculators(state, spec)
    assert torch.equal(out["layers.0.self_attn.o_proj.bias"], torch.zeros(H))
    assert out["layers.0.self_attn.q_proj.bias"].shape == (HQ * D,)
    assert e3.speculators_config(spec, TARGET)["transformer_layer_config"]["attention_bias"] is True
    back = e3.from_speculators(out, spec)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    out["layers.0.self_attn.o_proj.bias"] = torch.ones(H)
    with pytest.raises(e3.Eagle3LayoutError, match="o_proj.bias is not zero"):
        e3.from_speculators(out, spec)
    assert e3.speculators_problems(spec) == []
    assert any("qkv_bias" in p for p in e3.sglang_problems(spec))


def test_vocabulary_maps_that_disagree_are_refused():
    spec = _spec()
    out = e3.to_sglang(_state(spec), spec)
    out["t2d"] = out["t2d"].clone()
    out["t2d"][int(out["t2d"].logical_not().nonzero()[0])] = True
    with pytest.raises(LayoutError, match="d2t and t2d"):  # the maps are every layout's (export/layouts.py)
        e3.from_sglang(out, spec)


@pytest.mark.parametrize(("over", "target", "match"), [
    ({"head_type": "mtp"}, TARGET, "take eagle3 heads"),
    ({"draft_vocab_size": 0}, TARGET, "draft_vocab_size=0"),
    ({"fc_bias": True}, TARGET, "fc_bias=True"),
    ({"aux_layers": (2, 4)}, TARGET, "exactly 3"),
    ({"aux_layers": (0, 4, 5)}, TARGET, r"hidden_states\[1..7\]"),
    ({"aux_layers": (2, 4, L)}, TARGET, r"hidden_states\[1..7\]"),
    ({}, {**TARGET, "model_type": "qwen3", "head_dim": D}, "q/k norms"),
    ({}, {**TARGET, "model_type": "mistral", "sliding_window": 16}, "sliding_window=16"),
])
def test_heads_that_do_not_fit_are_named(over, target, match):
    spec = _spec(target, **over)
    for problems in (e3.speculators_problems(spec), e3.sglang_problems(spec)):
        assert any(re.search(match, p) for p in problems), problems
    assert e3.speculators_problems(_spec()) == [] and e3.sglang_problems(_spec()) == []


class _StubEagle3Head:
    """What the exporter reads of a head (cfg, target_args, state_dict), standing in for the eagle3 head."""

    def __init__(self, spec: e3.Eagle3Spec, **cfg):
        self.cfg = SimpleNamespace(**{"type": "eagle3", "aux_layers": list(spec.aux_layers), "fc_bias": False,
                                      "draft_vocab_size": spec.draft_vocab_size, "aux_norm": spec.aux_norm,
                                      "settings": SimpleNamespace(norm_output=spec.norm_output,
                                                                  fc_input_norm=spec.fc_input_norm,
                                                                  norm_before_residual=spec.norm_before_residual),
                                      **cfg})
        self.target_args = spec.args
        self._state = _state(spec)

    def state_dict(self):
        return dict(self._state)


@pytest.mark.parametrize("fmt", ["speculators", "sglang-eagle3"])
def test_exporter_wires_the_layouts(fmt):
    head = _StubEagle3Head(_spec())
    tensors = layout_tensors(head, fmt)  # checks coverage and bit-exactness of the round trip itself
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= tensors.keys()
    assert LAYOUTS[fmt].keeps_draft_vocab and LAYOUTS[fmt].head_types == ("eagle3",)
    with pytest.raises(LayoutError, match="draft_vocab_size=0"):
        check_fits(_StubEagle3Head(_spec(), draft_vocab_size=0), fmt)
    with pytest.raises(LayoutError, match="takes eagle3 heads"):
        check_fits(_StubEagle3Head(_spec(), type="eagle1"), fmt)


def test_exporter_reports_a_head_tensor_the_layout_leaves_out():
    head = _StubEagle3Head(_spec())
    head._state["embed_norm.weight"] = torch.ones(H)
    with pytest.raises(LayoutError, match=r"missing \['embed_norm.weight'\]"):
        layout_tensors(head, "speculators")


def test_eagle31_in_the_speculators_layout():
    """head.aux_norm → speculators' / vLLM's `fc_norm` (tensors `fc_norm.{i}.weight`, vLLM loads them as
    `model.fc_norm.{i}`), head.norm_output → `norm_output`; both written into config.json."""
    spec = _spec(aux_norm=True, norm_output=True)
    state = _state(spec)
    out = e3.to_speculators(state, spec)
    assert {k for k in out if "norm." in k and not k.startswith("layers.")} == {
        "norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert not any(k.startswith("aux_norm.") for k in out)
    for i in range(3):
        assert torch.equal(out[f"fc_norm.{i}.weight"], state[f"aux_norm.{i}.weight"])
    back = e3.from_speculators(out, spec)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    cfg = e3.speculators_config(spec, TARGET)
    assert (cfg["fc_norm"], cfg["norm_output"], cfg["norm_before_fc"]) == (True, True, False)
    only_output = e3.speculators_config(_spec(norm_output=True), TARGET)
    assert (only_output["fc_norm"], only_output["norm_output"]) == (False, True)
    assert e3.speculators_problems(spec) == []
    tensors = layout_tensors(_StubEagle3Head(spec), "speculators")  # coverage and exactness through the exporter
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= tensors.keys()


@pytest.mark.parametrize("flag", ["aux_norm", "norm_output"])
def test_sglang_refuses_the_eagle31_flags_by_name(flag):
    spec = _spec(**{flag: True})
    assert [p for p in e3.sglang_problems(spec) if f"head.{flag}=true" in p and "SGLang" in p]
    with pytest.raises(LayoutError, match=f"head.{flag}=true"):
        check_fits(_StubEagle3Head(spec), "sglang-eagle3")


def test_speculators_norms_in_the_speculators_layout():
    """head.fc_input_norm → speculators' `norm_before_fc` with its `input_norm.weight` [k·H] (vLLM builds
    `model.input_norm` from the flag and loads the tensor there), head.norm_before_residual → `norm_before_residual`
    (vLLM's `_norm_before_residual`); the maps stay exact inverses, and the flags are written as they are."""
    spec = _spec(fc_input_norm=True, norm_before_residual=True, norm_output=True)
    state = _state(spec)
    out = e3.to_speculators(state, spec)
    assert torch.equal(out["input_norm.weight"], state["fc_input_norm.weight"]) and out["input_norm.weight"].shape == (
        3 * H,)
    assert not any(k.startswith("fc_input_norm.") for k in out)
    back = e3.from_speculators(out, spec)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    cfg = e3.speculators_config(spec, TARGET)
    flags = ("norm_before_fc", "norm_before_residual", "norm_output", "fc_norm")
    assert {k: cfg[k] for k in flags} == {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True,
                                          "fc_norm": False}
    only = e3.speculators_config(_spec(norm_before_residual=True), TARGET)
    assert (only["norm_before_residual"], only["norm_before_fc"]) == (True, False)
    assert e3.speculators_problems(spec) == []
    tensors = layout_tensors(_StubEagle3Head(spec), "speculators")  # coverage and exactness through the exporter
    assert "input_norm.weight" in tensors


def test_speculators_refuses_norm_before_fc_with_fc_norm_and_sglang_refuses_both_switches():
    both = _spec(fc_input_norm=True, aux_norm=True)
    assert [p for p in e3.speculators_problems(both) if "norm_before_fc with fc_norm" in p]
    with pytest.raises(LayoutError, match="head.fc_input_norm=true with head.aux_norm=true"):
        check_fits(_StubEagle3Head(both), "speculators")
    for flag in ("fc_input_norm", "norm_before_residual"):
        spec = _spec(**{flag: True})
        assert e3.speculators_problems(spec) == []
        with pytest.raises(LayoutError, match=f"head.{flag}=true: SGLang's LlamaForCausalLMEagle3 layout has no"):
            check_fits(_StubEagle3Head(spec), "sglang-eagle3")


@pytest.mark.parametrize("flags", [
    {"fc_input_norm": True, "norm_before_residual": True, "norm_output": True, "train_lm_head": False},
    {"norm_before_residual": True}], ids=["speculators-recipe", "norm-before-residual"])
def test_a_head_with_speculators_settings_exports_and_reads_back_exactly(tmp_path, flags):
    """A real eagle3 head with speculators' switches (its weights moved off their start): `format=speculators`
    writes the tensors and config keys vLLM reads, and the export loads back into a head whose features equal the
    trained head's bit for bit (the exporter's own round trip and `verify_round_trip`)."""
    from safetensors import safe_open

    from mtp_train.config import HeadConfig
    from mtp_train.export import export_head, load_export, verify_round_trip
    from mtp_train.heads import build_head, save_head
    from tests.conftest import make_tiny_checkpoint

    target = tmp_path / "target"
    make_tiny_checkpoint("llama", target, num_hidden_layers=5)  # the engines capture hidden_states[1..L-1]
    head = build_head(HeadConfig.of(type="eagle3", aux_layers=[1, 2, 4], draft_vocab_size=64, **flags), target,
                      dtype="float32")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    out = export_head(save_head(head, tmp_path / "head"), target, "speculators", tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["norm_before_fc"] is bool(flags.get("fc_input_norm")) and cfg["norm_before_residual"] is True
    assert cfg["norm_output"] is bool(flags.get("norm_output")) and cfg["fc_norm"] is False
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        if flags.get("fc_input_norm"):
            assert tuple(f.get_tensor("input_norm.weight").shape) == (3 * head.args.hidden_size,)
    assert ("input_norm.weight" in names) is bool(flags.get("fc_input_norm"))
    assert not any(n.startswith("fc_input_norm") for n in names)
    back = load_export(out, target, dtype=torch.float32)
    assert back.cfg.settings == head.cfg.settings and back.lm_head.weight.requires_grad is head.train_lm_head
    sd = head.state_dict()
    assert back.state_dict().keys() == sd.keys()
    assert all(torch.equal(v, sd[k]) for k, v in back.state_dict().items())
    assert verify_round_trip(tmp_path / "head", out, target) == 0.0
