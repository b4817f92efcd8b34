"""Qwen3-MoE targets (Qwen3 attention with sparse MoE layers, grouped expert products): parity with transformers on
tiny random configs (every hidden state, logits, paged greedy decoding = HF generate), speculative decoding with the
target as its own draft (greedy = plain), precompute, and mtp / eagle3 heads trained a few steps on it."""

from __future__ import annotations

import pytest
import torch

from mtp_train.config import HeadConfig
from mtp_train.heads import build_head
from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.families.qwen3_moe import grouped_experts
from tests._family import (
    assert_greedy_matches_generate,
    assert_head_trains_and_drafts_losslessly,
    assert_layers_and_logits_match,
    assert_precompute_stores_hidden,
    save_random,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6)
CONFIGS = {
    # every layer sparse, renormalised top-k (the released Qwen3-30B-A3B routing)
    "sparse": {"norm_topk_prob": True},
    # transformers' defaults elsewhere: raw top-k weights; a dense layer listed, and every second layer sparse
    "mixed": {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": [3], "num_experts_per_tok": 3,
              "tie_word_embeddings": True},
}
PROMPTS = [[3, 17, 42, 9, 100, 7, 8, 200, 13], [5, 6], list(range(30, 52))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers

    def router(name, t):
        if name.endswith("mlp.gate.weight"):
            t.normal_(0, 0.5)  # a router with real preferences

    root = tmp_path_factory.mktemp("q3moe")
    return {name: (root / name, save_random(transformers.Qwen3MoeConfig(**{**BASE, **over}), root / name, router))
            for name, over in CONFIGS.items()}


def test_layers_are_sparse_by_transformers_rule(checkpoints):
    kinds = {name: [type(layer.mlp).__name__ for layer in load_model(path).model.layers]
             for name, (path, _) in checkpoints.items()}
    assert kinds["sparse"] == ["SparseMoE"] * 4
    assert kinds["mixed"] == ["MLP", "SparseMoE", "MLP", "MLP"]  # (i + 1) % 2 == 0, except listed layer 3


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hidden_states_and_logits_match_transformers(checkpoints, name):
    path, hf = checkpoints[name]
    assert_layers_and_logits_match(load_model(path, dtype="float32", backend="torch"), hf, PROMPTS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_decode_and_speculative_decoding_equal_transformers_generate(checkpoints, name):
    path, hf = checkpoints[name]
    assert_greedy_matches_generate(load_model(path, dtype="float32", backend="torch"), hf, PROMPTS)


def test_grouped_experts_equal_a_loop_over_tokens():
    """The grouped products against the plain definition, token by token, with repeated and unused experts."""
    from mtp_train.models.families.qwen3_moe import Expert

    torch.manual_seed(1)
    experts = torch.nn.ModuleList(Expert(8, 5) for _ in range(4)).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    ids = torch.tensor([[0, 2], [2, 0], [3, 2], [0, 3], [2, 3], [0, 2]])  # expert 1 never hit
    w = torch.rand(6, 2, dtype=torch.float64)
    ref = torch.stack([sum(w[t, j] * experts[int(ids[t, j])](x[t:t + 1])[0] for j in range(2)) for t in range(6)])
    torch.testing.assert_close(grouped_experts(x, w.float(), ids, experts), ref, rtol=1e-6, atol=1e-6)


def test_precompute_stores_the_models_hidden_states(checkpoints, tmp_path):
    path, _ = checkpoints["mixed"]
    assert_precompute_stores_hidden(load_model(path, dtype="float32", backend="torch"), path, PROMPTS, tmp_path / "pc")


@pytest.mark.parametrize("head_cfg", [HeadConfig(type="mtp"), HeadConfig(type="mtp", moe=True),
                                      HeadConfig(type="eagle3", draft_vocab_size=64, aux_layers=[1, 2, 3])],
                         ids=["mtp", "mtp-moe", "eagle3"])
def test_heads_train_on_it_and_draft_losslessly(checkpoints, head_cfg):
    path, _ = checkpoints["sparse"]
    model = load_model(path, dtype="float32", backend="torch")
    torch.manual_seed(0)
    head = build_head(head_cfg, path, dtype="float32")
    if head_cfg.moe:
        assert type(head.layers[0].mlp).__name__ == "SparseMoE"
    assert_head_trains_and_drafts_losslessly(model, head, PROMPTS)


def test_a_config_without_experts_is_refused_naming_the_keys(tmp_path):
    from mtp_train.models.families import args_from_hf_config

    cfg = {**BASE, "model_type": "qwen3_moe", "num_experts": 0}
    with pytest.raises(ModelConfigError, match="num_experts and moe_intermediate_size"):
        args_from_hf_config(cfg, "x/config.json")
    with pytest.raises(ModelConfigError, match="num_experts_per_tok=9"):
        args_from_hf_config({**cfg, "num_experts": 8, "num_experts_per_tok": 9}, "x/config.json")
