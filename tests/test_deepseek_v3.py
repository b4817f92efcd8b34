"""DeepSeek-V3 / Kimi-K2 targets (V2's MLA with V3's sigmoid router: correction bias, group-limited top-k, scaling,
shared experts, dense layers first): the router against transformers', parity on tiny random configs (every hidden
state, logits, paged greedy decoding = HF generate), speculative decoding with the target as its own draft (greedy =
plain), precompute, mtp heads (dense and MoE block) trained a few steps on it, and the configs refused by name."""

from __future__ import annotations

import pytest
import torch

from mtp_train.config import HeadConfig
from mtp_train.engine import prefill_hidden
from mtp_train.heads import build_head
from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.families import args_from_hf_config
from tests._family import (
    assert_greedy_matches_generate,
    assert_head_trains_and_drafts_losslessly,
    assert_layers_and_logits_match,
    assert_precompute_stores_hidden,
    save_random,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=512, tie_word_embeddings=False)
CONFIGS = {
    # DeepSeek-V3's routing: q LoRA, 4 groups of 2 experts with the best 2 groups eligible, renormalised, scaled
    "v3": {"q_lora_rank": 24, "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
           "n_shared_experts": 2, "tie_word_embeddings": True},
    # plain q_proj, one group (no limit), raw sigmoid weights, two dense layers first
    "plain": {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
              "routed_scaling_factor": 1.5, "first_k_dense_replace": 2, "num_experts_per_tok": 3},
    # Kimi-K2's shape: one group, its scaling and YaRN (factor 32, beta 1 / 1), on a short original context
    "kimi": {"q_lora_rank": 24, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                 "original_max_position_embeddings": 16, "beta_fast": 1.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0}},
}
PROMPTS = [[3, 17, 42, 9, 100, 7, 8, 200, 13], [5, 6], list(range(30, 52))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers

    def router(name, t):
        if name.endswith("mlp.gate.weight"):
            t.normal_(0, 0.5)  # a router with real preferences
        elif name.endswith("e_score_correction_bias"):
            t.normal_(0, 0.3)  # comparable to the sigmoid scores' spread, so it changes the choice

    root = tmp_path_factory.mktemp("ds3")
    return {name: (root / name, save_random(transformers.DeepseekV3Config(**{**BASE, **over}), root / name, router))
            for name, over in CONFIGS.items()}


def test_layers_are_dense_before_first_k_dense_replace(checkpoints):
    kinds = {name: [type(layer.mlp).__name__ for layer in load_model(path).model.layers]
             for name, (path, _) in checkpoints.items()}
    assert kinds["v3"] == ["DenseMLP", "MoE", "MoE"] and kinds["plain"] == ["DenseMLP", "DenseMLP", "MoE"]


@pytest.mark.parametrize("name", ["v3", "kimi"])
def test_router_chooses_by_the_biased_scores_and_weighs_by_the_unbiased_ones(checkpoints, name):
    """Our router = transformers' DeepseekV3TopkRouter (same experts, same weights), and the bias matters."""
    path, hf = checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    ours, theirs = model.model.layers[-1].mlp.gate, hf.model.layers[-1].mlp.gate
    bias = ours.e_score_correction_bias
    assert not bias.requires_grad and bias.abs().sum() > 0
    torch.testing.assert_close(bias, theirs.e_score_correction_bias, rtol=0, atol=0)
    torch.manual_seed(3)
    x = torch.randn(64, BASE["hidden_size"])
    w, idx = ours(x)
    with torch.no_grad():
        _, hf_w, hf_idx = theirs(x)
    order, hf_order = idx.sort(-1), hf_idx.sort(-1)  # transformers' top-k is unsorted
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), hf_w.gather(1, hf_order.indices), rtol=1e-6, atol=1e-7)
    # the weights are the un-biased sigmoid scores of the chosen experts (renormalised, scaled)
    a = model.args
    raw = torch.sigmoid(x @ ours.weight.T).gather(1, idx)
    want = raw / raw.sum(-1, keepdim=True) if a.norm_topk_prob else raw
    torch.testing.assert_close(w, want * a.routed_scaling_factor, rtol=1e-6, atol=1e-7)
    # without the correction bias other experts are chosen for some tokens
    with torch.no_grad():
        saved = bias.clone()
        bias.zero_()
        _, unbiased = ours(x)
        bias.copy_(saved)
    assert not torch.equal(unbiased.sort(-1).values, order.values)


def test_group_limit_keeps_experts_inside_the_best_groups(checkpoints):
    path, _ = checkpoints["v3"]
    gate = load_model(path, dtype="float32", backend="torch").model.layers[1].mlp.gate
    torch.manual_seed(4)
    x = torch.randn(256, BASE["hidden_size"])
    _, idx = gate(x)
    choice = torch.sigmoid(x @ gate.weight.T) + gate.e_score_correction_bias  # (T, 8): 4 groups of 2
    best_groups = choice.view(-1, 4, 2).sum(-1).topk(2, -1).indices  # top-2 of 2 experts = the group's sum
    assert all(set((idx[t] // 2).tolist()) <= set(best_groups[t].tolist()) for t in range(len(x)))
    # and the limit binds: the unlimited top-2 of the biased scores leaves the best groups for some tokens
    free = choice.topk(2, -1).indices // 2
    assert any(not set(free[t].tolist()) <= set(best_groups[t].tolist()) for t in range(len(x)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hidden_states_and_logits_match_transformers(checkpoints, name):
    path, hf = checkpoints[name]
    assert_layers_and_logits_match(load_model(path, dtype="float32", backend="torch"), hf, PROMPTS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_decode_and_speculative_decoding_equal_transformers_generate(checkpoints, name):
    path, hf = checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    assert model.args.num_kv_heads == 1 and model.args.head_dim == 32 + 8  # one latent row per token and layer
    assert_greedy_matches_generate(model, hf, PROMPTS)


def test_precompute_stores_the_models_hidden_states(checkpoints, tmp_path):
    path, _ = checkpoints["v3"]
    assert_precompute_stores_hidden(load_model(path, dtype="float32", backend="torch"), path, PROMPTS, tmp_path / "pc")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_mtp_head_with_a_deepseek_block_trains_and_drafts_losslessly(checkpoints, moe):
    path, _ = checkpoints["v3"]
    model = load_model(path, dtype="float32", backend="torch")
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="mtp", moe=moe, init="last_layer" if moe else "scratch"), path, dtype="float32")
    block = head.layers[0]
    assert type(block.self_attn).__name__ == "MLAttention"
    assert type(block.mlp).__name__ == ("MoE" if moe else "DenseMLP")
    if moe:  # the target's last layer, its correction bias included, and the bias stays out of training
        bias = block.mlp.gate.e_score_correction_bias
        torch.testing.assert_close(bias, model.model.layers[-1].mlp.gate.e_score_correction_bias, rtol=0, atol=0)
        assert not bias.requires_grad
    assert_head_trains_and_drafts_losslessly(model, head, PROMPTS, k=3, max_new_tokens=12)


def test_eagle_heads_are_refused_and_backends_named(checkpoints):
    path, _ = checkpoints["plain"]
    with pytest.raises(ModelConfigError, match="DeepSeek-V3 target takes an mtp head"):
        build_head(HeadConfig(type="eagle1"), path)
    assert type(load_model(path, backend="auto").attn).__name__ == "TorchMLA"
    with pytest.raises(ModelConfigError, match="DeepSeek-V3 \\(MLA\\): the flashinfer MLA backend needs a CUDA"):
        load_model(path, backend="flashinfer")


def test_tensor_parallel_refuses_a_tp_that_does_not_divide_the_heads(checkpoints):
    """TP = 2 against TP = 1 is tests/test_tp_moe.py's; tp = 8 over 4 heads is refused naming them."""
    from mtp_train.models.tensor_parallel import TPGroup, load_model_tp

    with pytest.raises(ModelConfigError, match="num_heads=4 divisible by 8"):
        load_model_tp(checkpoints["plain"][0], TPGroup(0, 8))


def _cfg(**over) -> dict:
    return {**BASE, "model_type": "deepseek_v3", "n_group": 4, "topk_group": 2, **over}


@pytest.mark.parametrize("over,match", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},
     "quantization_config \\(quant_method 'awq'\\) is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    ({"rope_interleave": False}, "rope_interleave=False is not supported"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ({"n_group": 3}, "n_group=3 must divide n_routed_experts=8"),
    ({"topk_group": 5}, "topk_group=5 must be in 1..n_group"),
    ({"n_group": 8, "topk_group": 4}, "n_group=8 leaves 1 expert"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be in 1..4"),
    ({"n_routed_experts": 0}, "needs n_routed_experts > 0"),
], ids=["fp8", "softmax", "topk", "rope", "freq", "groups", "topk-group", "group-size", "k", "no-experts"])
def test_configs_it_does_not_run_are_refused_naming_the_key(over, match):
    with pytest.raises(ModelConfigError, match=match):
        args_from_hf_config(_cfg(**over), "x/config.json")


def test_the_released_routing_keys_parse():
    """DeepSeek-V3's own config.json spells its routing out; Kimi-K2's has one group."""
    a = args_from_hf_config(_cfg(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
                                 num_nextn_predict_layers=1, routed_scaling_factor=2.5), "x/config.json")
    assert (a.n_group, a.topk_group, a.topk_method, a.norm_topk_prob) == (4, 2, "noaux_tc", True)
    assert a.num_nextn_predict_layers == 1 and a.routed_scaling_factor == 2.5
    assert a.kv_layout.latent and a.kv_layout.head_dim == 32 + 8


def test_a_kimi_k2_config_runs_as_deepseek_v3(checkpoints, tmp_path):
    """Kimi-K2's config.json names model_type kimi_k2 over DeepSeek-V3's architecture and tensor names."""
    import json
    import shutil

    from mtp_train.models.families import family_of

    path, _ = checkpoints["kimi"]
    kimi = tmp_path / "kimi"
    shutil.copytree(path, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    model, ref = load_model(kimi, dtype="float32", backend="torch"), load_model(path, dtype="float32", backend="torch")
    assert family_of(model.args).name == "deepseek_v3" and model.args.model_type == "kimi_k2"
    torch.testing.assert_close(prefill_hidden(model, PROMPTS).hidden, prefill_hidden(ref, PROMPTS).hidden,
                               rtol=0, atol=0)
