"""Per-layer switches: Qwen2 / Qwen3 slide a window only on the layers transformers slides (from
`max_window_layers` on, or those `layer_types` names), with hidden states, logits and greedy decoding equal to
transformers'; every family reads its own switches as its transformers config class does, and refuses by name a
per-layer key it does not read whose reading would give other layers."""

from __future__ import annotations

import pytest
import torch

from mtp_train.layers.attention import LayerWindowAttention
from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.families import args_from_hf_config
from tests._family import assert_greedy_matches_generate, assert_layers_and_logits_match

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 4  # short, so it bites within the prompts below
LAYERS = 3
_BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
CLASSES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
PROMPTS = [list(range(5, 29)), [7, 3, 99, 100, 4, 8, 1, 2, 60, 61, 62, 9, 10]]


def _checkpoint(path, model_type: str, **over):
    import transformers

    from tests._family import save_random

    def init(name: str, t: torch.Tensor) -> None:
        if name.endswith("bias"):
            t.normal_(0, 0.1)

    cfg = getattr(transformers, CLASSES[model_type])(**{**_BASE, "head_dim": 8, **over})
    return save_random(cfg, path, init)


@pytest.mark.parametrize("model_type", list(CLASSES))
@pytest.mark.parametrize("max_window_layers", [0, 1, LAYERS + 2])
def test_qwen_windows_slide_the_layers_transformers_slides(tmp_path, model_type, max_window_layers):
    hf = _checkpoint(tmp_path, model_type, use_sliding_window=True, sliding_window=WINDOW,
                     max_window_layers=max_window_layers)
    expected = [WINDOW if i >= max_window_layers else None for i in range(LAYERS)]
    assert hf.config.layer_types == ["sliding_attention" if w else "full_attention" for w in expected]
    model = load_model(tmp_path, dtype="float32", backend="torch")
    assert model.args.windows == expected
    assert isinstance(model.attn, LayerWindowAttention) == (len(set(expected)) > 1)
    assert_layers_and_logits_match(model, hf, PROMPTS)
    if max_window_layers == 1:  # mixed layers through paged decode and verify steps
        assert_greedy_matches_generate(model, hf, PROMPTS[:1], max_new_tokens=10)


def test_qwen_layer_types_name_the_sliding_layers(tmp_path):
    """An explicit layer_types (full, sliding, full) is what transformers follows (it saves max_window_layers=28
    beside it)."""
    types = ["full_attention", "sliding_attention", "full_attention"]
    hf = _checkpoint(tmp_path, "qwen3", use_sliding_window=True, sliding_window=WINDOW, layer_types=types)
    model = load_model(tmp_path, dtype="float32", backend="torch")
    assert model.args.windows == [None, WINDOW, None]
    assert_layers_and_logits_match(model, hf, PROMPTS)


def _cfg(model_type: str, **over) -> dict:
    return {**_BASE, "model_type": model_type, **over}


@pytest.mark.parametrize(("cfg", "windows"), [
    # transformers' defaults: sliding_window 4096, max_window_layers 28 when absent
    (_cfg("qwen2", use_sliding_window=True), [None] * LAYERS),
    (_cfg("qwen2", use_sliding_window=True, num_hidden_layers=30), [None] * 28 + [4096] * 2),
    (_cfg("qwen3", use_sliding_window=False, sliding_window=8, max_window_layers=0), [None] * LAYERS),
    (_cfg("qwen3", use_sliding_window=True, sliding_window=None, max_window_layers=0), [None] * LAYERS),
    (_cfg("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1,
          layer_types=["full_attention", "sliding_attention", "sliding_attention"]), [None, 8, 8]),
    (_cfg("qwen2", layer_types=["sliding_attention"] * LAYERS, sliding_window=8), [None] * LAYERS),  # switch off
    (_cfg("mistral"), [4096] * LAYERS),
    (_cfg("mistral", sliding_window=None), [None] * LAYERS),
    (_cfg("mistral", sliding_window=8, layer_types=["sliding_attention"] * LAYERS), [8] * LAYERS),
    (_cfg("llama", layer_types=["full_attention"] * LAYERS), [None] * LAYERS),
    (_cfg("qwen3_moe", use_sliding_window=True, sliding_window=8, max_window_layers=0, num_experts=4,
          moe_intermediate_size=16), [8] * LAYERS),
    (_cfg("qwen3_moe", use_sliding_window=False, max_window_layers=LAYERS, num_experts=4, moe_intermediate_size=16),
     [None] * LAYERS),
])
def test_windows_are_read_as_transformers_reads_them(cfg, windows):
    import transformers

    a = args_from_hf_config(cfg)
    assert a.windows == windows
    ref = transformers.AutoConfig.for_model(**cfg)
    types = getattr(ref, "layer_types", None)
    if cfg["model_type"] in ("qwen2", "qwen3"):  # the config class derives them
        assert [ref.sliding_window if t == "sliding_attention" else None for t in types] == windows


def test_gpt_oss_takes_its_config_class_default_window():
    cfg = _cfg("gpt_oss", head_dim=8, num_local_experts=4, num_experts_per_tok=2)
    assert args_from_hf_config(cfg).windows == [128, None, 128]


def test_deepseek_v3_is_dense_on_its_first_three_layers_when_the_key_is_absent():
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=5,
               num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
               n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, model_type="deepseek_v3")
    assert args_from_hf_config(cfg).first_k_dense_replace == 3  # DeepseekV3Config's default


_MOE = dict(num_experts=4, moe_intermediate_size=16, num_experts_per_tok=2)
_GPT_OSS = dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
_DEEPSEEK = dict(moe_intermediate_size=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                 n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1)


@pytest.mark.parametrize(("cfg", "message"), [
    # a key the type does not read, whose reading gives other layers, is refused by name
    (_cfg("mistral", sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
     r"layer_types=.*layers \[0, 2\].*transformers' Mistral ignores it and gives it to layers \[0, 1, 2\]"),
    (_cfg("mistral", sliding_window=8, use_sliding_window=True, max_window_layers=1), "max_window_layers=1"),
    (_cfg("llama", sliding_window=8), "sliding_window=8 in a llama config"),
    (_cfg("llama", layer_types=["sliding_attention"] * LAYERS), "transformers' Llama ignores it"),
    (_cfg("qwen3_moe", use_sliding_window=True, sliding_window=8, max_window_layers=1, **_MOE),
     r"max_window_layers=1 .*transformers' Qwen3-MoE ignores it and gives it to layers \[0, 1, 2\]"),
    (_cfg("qwen3_moe", use_sliding_window=True, sliding_window=8, **_MOE,
          layer_types=["full_attention", "sliding_attention", "sliding_attention"]), "layer_types="),
    (_cfg("qwen3_moe", mlp_layer_types=["dense", "sparse", "sparse"], **_MOE), "mlp_layer_types="),
    (_cfg("qwen3_moe", mlp_only_layers=[7], **_MOE), r"mlp_only_layers=\[7\] must list layer indices in 0..2"),
    (_cfg("gpt_oss", mlp_only_layers=[0], **_GPT_OSS), r"mlp_only_layers=\[0\].*transformers' GPT-OSS ignores it"),
    (_cfg("gpt_oss", max_window_layers=0, use_sliding_window=True, **_GPT_OSS), "use_sliding_window=True, max_"),
    (_cfg("qwen2", no_rope_layers=[1, 0, 1]), r"no_rope_layers=\[1, 0, 1\] would give no RoPE to layers \[1\]"),
    (_cfg("deepseek_v2", moe_layer_freq=2, **_DEEPSEEK), r"moe_layer_freq=2 would give the sparse MoE block to "
                                                         r"layers \[2\]"),
    (_cfg("deepseek_v2", mlp_only_layers=[2], **_DEEPSEEK), r"mlp_only_layers=\[2\]"),
    # the type's own keys, checked
    (_cfg("qwen2", use_sliding_window=True, sliding_window=0), "sliding_window=0 must be a positive integer"),
    (_cfg("qwen2", layer_types=["full_attention", "chunked_attention", "full_attention"]),
     "layer_types must list 3 of sliding_attention, full_attention"),
    (_cfg("deepseek_v2", **{**_DEEPSEEK, "first_k_dense_replace": None}),
     "first_k_dense_replace is null, not an integer"),
])
def test_per_layer_keys_a_family_does_not_read_are_refused_by_name(cfg, message):
    with pytest.raises(ModelConfigError, match=message):
        args_from_hf_config(cfg, "x/config.json")


@pytest.mark.parametrize("cfg", [
    # neutral: the key's reading gives the family's own layers
    _cfg("mistral", sliding_window=8, max_window_layers=0, use_sliding_window=True),
    _cfg("gpt_oss", mlp_only_layers=[], decoder_sparse_step=1, first_k_dense_replace=0, **_GPT_OSS),
    _cfg("qwen3_moe", first_k_dense_replace=0, moe_layer_freq=1, mlp_layer_types=["sparse"] * LAYERS, **_MOE),
    _cfg("deepseek_v2", moe_layer_freq=1, **_DEEPSEEK),
    _cfg("llama", mlp_only_layers=[1], decoder_sparse_step=2, no_rope_layers=[1] * LAYERS),  # dense: no experts
])
def test_keys_that_agree_with_the_family_are_accepted(cfg):
    args_from_hf_config(cfg)
