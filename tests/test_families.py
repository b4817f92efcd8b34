"""The target-family registry: every family has its entries, fusing and unfusing round-trip on a tiny random config
of every family, the loader, tensor parallelism and the heads consult the family, and nothing else branches on
`model_type`. Each family's parity with transformers is its own test file (test_llama.py, test_deepseek_v2.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mtp_train.config import HEAD_TYPES, HeadConfig
from mtp_train.heads import head_class, read_decoder_layer
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.models import CausalLM, ModelConfigError, load_model
from mtp_train.models.families import (
    Family,
    args_from_hf_config,
    families,
    family_for_type,
    family_of,
    supported_model_types,
)
from mtp_train.models.fusing import fuse, fusion_plan, parts_plan, unfuse
from mtp_train.models.tensor_parallel import TPGroup, load_model_tp, local_args

pytestmark = pytest.mark.usefixtures("one_thread")

PACKAGE = Path(__file__).resolve().parents[1] / "mtp_train"
_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
_DEEPSEEK = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                 n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                 max_position_embeddings=128, tie_word_embeddings=False)
# family name → tiny config.json dicts covering what differs inside it (a new family adds its row here)
TINY: dict[str, dict[str, dict]] = {
    "llama": {
        "llama": {**_LLAMA, "model_type": "llama"},
        "mistral": {**_LLAMA, "model_type": "mistral", "sliding_window": 8},
        "qwen2": {**_LLAMA, "model_type": "qwen2"},  # q/k/v biases
        "qwen3": {**_LLAMA, "model_type": "qwen3", "head_dim": 16},  # q/k norms, head_dim ≠ H / Hq
        "attention-bias": {**_LLAMA, "model_type": "llama", "attention_bias": True, "mlp_bias": True},
    },
    "deepseek_v2": {
        "lite": {**_DEEPSEEK, "model_type": "deepseek_v2", "q_lora_rank": None},
        "q-lora": {**_DEEPSEEK, "model_type": "deepseek_v2", "q_lora_rank": 12},
    },
    "deepseek_v3": {  # V3's router: sigmoid scores, correction bias, 2 groups of 2 experts with the best one eligible
        "v3": {**_DEEPSEEK, "model_type": "deepseek_v3", "q_lora_rank": 12, "n_group": 2, "topk_group": 1,
               "routed_scaling_factor": 2.5},
        # Kimi-K2's config.json names its own model_type: one routing group
        "kimi": {**_DEEPSEEK, "model_type": "kimi_k2", "q_lora_rank": None, "n_group": 1, "topk_group": 1},
    },
    "gpt_oss": {  # attention sinks, sliding / full layers, fused clamped-SwiGLU experts with biases, YaRN
        "alternating": {**_LLAMA, "model_type": "gpt_oss", "head_dim": 16, "num_local_experts": 4,
                        "num_experts_per_tok": 2, "sliding_window": 4,
                        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                            "truncate": False, "rope_theta": 150000.0}},
    },
    "qwen3_moe": {
        "sparse": {**_LLAMA, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 16, "norm_topk_prob": True, "decoder_sparse_step": 2},
    },
}
CASES = [(fam, name) for fam, configs in TINY.items() for name in configs]


def _random_model(cfg: dict, seed: int = 0) -> CausalLM:
    """Our model of config `cfg` with random weights (norms away from 1, biases non-zero) and a torch backend."""
    args = args_from_hf_config(cfg, source="tiny")
    family = family_of(args)
    torch.manual_seed(seed)
    model = family.model(args)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if n.endswith("norm.weight") else torch.randn_like(p) * 0.2)
    model.attn = family.attention(args, "torch", "cpu", torch.float32)
    return model.eval().requires_grad_(False)


def _checkpoint(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under the checkpoint's names (the family's fused projections split)."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return unfuse(params, family_of(model.args).fusings, model.args)


def _save(model: CausalLM, cfg: dict, folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(_checkpoint(model), str(folder / "model.safetensors"))
    return folder


def test_every_family_has_its_entries_and_a_tiny_config():
    found = families()
    assert {f.name for f in found} == set(TINY), "every family needs tiny configs in TINY (and its parity test)"
    claimed = [t for f in found for t in f.model_types]
    assert len(claimed) == len(set(claimed)) and sorted(claimed) == sorted(supported_model_types())
    for f in found:
        assert isinstance(f, Family) and f.model_types and f.title
        assert issubclass(f.model, CausalLM)
        assert all(callable(x) for x in (f.parse, f.attention, f.head_block, f.adapt_attention, f.rope))
        assert all(family_for_type(t) is f for t in f.model_types)
        assert f.head_types is None or (f.head_types and f.head_note)
        for fusing in f.fusings:
            assert fusing.name not in fusing.parts and len(fusing.parts) > 1
    assert family_for_type("gpt2") is None and family_for_type(None) is None
    covered = {args_from_hf_config(cfg).model_type for configs in TINY.values() for cfg in configs.values()}
    assert covered == set(supported_model_types())


def test_unknown_model_type_names_every_supported_one():
    with pytest.raises(ModelConfigError, match="model_type 'gpt2'.*supported: " + ", ".join(supported_model_types())):
        args_from_hf_config({**_LLAMA, "model_type": "gpt2"})


@pytest.mark.parametrize("family,name", CASES)
def test_fusing_and_unfusing_round_trip(family, name):
    model = _random_model(TINY[family][name])
    fam = family_of(model.args)
    assert fam.name == family
    params = {n: p for n, p in model.named_parameters()}
    ckpt = unfuse(params, fam.fusings, model.args)
    # the checkpoint side and the parameter side agree on what is fused from what
    plan = fusion_plan(params, fam.fusings)
    assert parts_plan(ckpt, fam.fusings) == plan
    assert not set(plan) & set(ckpt) and all(p in ckpt for parts in plan.values() for p in parts)
    back = fuse(dict(ckpt), plan)
    rest = {k: v for k, v in ckpt.items() if k not in {p for parts in plan.values() for p in parts}}
    assert back.keys() | rest.keys() == params.keys()
    for k, v in {**back, **rest}.items():
        assert torch.equal(v, params[k]), k
    if fam.fusings:  # every fused projection of every layer is split into the family's parts, with their rows
        for f in fam.fusings:
            layer = {k[len("model.layers.0."):]: v for k, v in ckpt.items() if k.startswith("model.layers.0.")}
            assert [layer[f"{p}.weight"].shape[0] for p in f.parts] == f.sizes(model.args)
    else:
        assert ckpt.keys() == params.keys()


@pytest.mark.parametrize("family,name", CASES)
def test_loader_and_layer_reader_read_a_checkpoint_through_the_family(family, name, tmp_path):
    cfg = TINY[family][name]
    model = _random_model(cfg)
    path = _save(model, cfg, tmp_path / name)
    loaded = load_model(path, dtype="float32", backend="torch", cpu_prepack=False)
    assert type(loaded) is family_of(model.args).model
    want = {n: p for n, p in model.named_parameters()}
    got = {n: p for n, p in loaded.named_parameters()}
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    ids = torch.tensor([3, 17, 42, 9, 33, 7, 8])
    torch.testing.assert_close(loaded(ids, AttentionMetadata.build([len(ids)])).hidden,
                               model(ids, AttentionMetadata.build([len(ids)])).hidden, rtol=0, atol=0)
    # a head's init from the target reads the last layer fused exactly as the loader fuses it
    last = read_decoder_layer(path, -1, dtype="float32")
    own = loaded.model.layers[-1].state_dict()
    assert last.keys() == own.keys() and all(torch.equal(last[k], own[k]) for k in own)


@pytest.mark.parametrize("family,name", CASES)
def test_a_heads_block_and_rope_are_the_targets(family, name):
    model = _random_model(TINY[family][name])
    fam, args = family_of(model.args), model.args
    head = head_class("mtp")(HeadConfig(type="mtp"), args, None)
    # the dense layer 0 of the target and the head's block have the same tensors (init_from_target copies them);
    # GPT-OSS has no dense layer, and its head's block leaves out the sinks (tests/test_gpt_oss.py checks it)
    if family != "gpt_oss":
        assert head.layers[0].state_dict().keys() == model.model.layers[0].state_dict().keys()
    positions = torch.arange(6)
    for got, want in zip(head.rope(positions, torch.float32), model.rope(positions, torch.float32)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert head.kv_shape[1] == args.kv_layout
    refused = [t for t in HEAD_TYPES if fam.head_types is not None and t not in fam.head_types]
    for t in refused:
        with pytest.raises(ModelConfigError, match=f"a {fam.title} target takes"):
            head_class(t)(HeadConfig(type=t, draft_vocab_size=64), args, None)  # otherwise valid
    if not fam.head_moe:
        with pytest.raises(ValueError, match="head.moe=true needs a"):
            head_class("mtp")(HeadConfig(type="mtp", moe=True), args, None)


@pytest.mark.parametrize("family,name", CASES)
def test_tensor_parallel_rules_fit_the_model_or_tp_is_refused(family, name, tmp_path):
    cfg = TINY[family][name]
    model = _random_model(cfg)
    fam = family_of(model.args)
    if fam.tp is None:
        path = _save(model, cfg, tmp_path / name)
        with pytest.raises(ModelConfigError, match=f"run {fam.title} with model.tp=1"):
            load_model_tp(path, TPGroup(0, 2))
        return
    layer = model.model.layers[0]
    for path in fam.tp.row:
        layer.get_submodule(path)  # every row-parallel module exists in the family's (first, dense) layer
    path = _save(model, cfg, tmp_path / name)
    for rank in (0, 1):  # a tensor its rules should split but miss would not fit the rank's shapes
        load_model_tp(path, TPGroup(rank, 2), dtype="float32", backend="torch", cpu_prepack=False)
    loc = local_args(model.args, 2)
    for field in fam.tp.divided:
        assert getattr(loc, field) * 2 == getattr(model.args, field)


def test_nothing_outside_the_registry_branches_on_model_type():
    branch = re.compile(r"model_type\s*(==|!=|\bin\b|\bnot in\b)")
    hits = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py") if "families" not in p.parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert hits == []
