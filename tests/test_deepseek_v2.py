"""DeepSeek-V2 targets (MLA with a compressed paged KV cache, decoupled RoPE, MoE): parity with transformers on tiny
random configs, paged decode = HF generate, and the model in precompute and speculative decoding."""

from __future__ import annotations

import pytest
import torch

from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.heads import HeadConfig, build_head
from mtp_train.models import ModelConfigError, load_model
from mtp_train.precompute import PrecomputedDataset, Sample, precompute
from mtp_train.spec.engine import SpecEngine
from mtp_train.spec.proposers import DraftModelProposer

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=512, tie_word_embeddings=False)
CONFIGS = {
    "lite": {"q_lora_rank": None},  # V2-Lite shape: plain q_proj, greedy routing
    "full": {"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
             "routed_scaling_factor": 1.5, "n_shared_experts": 2, "tie_word_embeddings": True},
    # the released V2-Lite's YaRN scaling (factor 40 from 4k), on a short original context so it bites here
    "yarn": {"q_lora_rank": None, "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 40.0,
                                                   "original_max_position_embeddings": 16, "beta_fast": 32,
                                                   "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}},
}
PROMPTS = [[3, 17, 42, 9, 100, 7, 8, 200, 13], [5, 6], list(range(30, 52))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers

    out = {}
    for name, over in CONFIGS.items():
        torch.manual_seed(0)
        cfg = transformers.DeepseekV2Config(**{**BASE, **over})
        hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif n.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)  # a router with real preferences
        path = tmp_path_factory.mktemp("ds") / name
        hf.save_pretrained(path, safe_serialization=True)
        out[name] = (path, hf)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hidden_states_and_logits_match_transformers(checkpoints, name):
    path, hf = checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    for ids in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True)
        out = prefill_hidden(model, [ids], hidden_layers=range(4))
        for j in range(4):
            torch.testing.assert_close(out.layers[j], ref.hidden_states[j][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.compute_logits(out.hidden), ref.logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_decode_and_speculative_decoding_equal_transformers_generate(checkpoints, name):
    path, hf = checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=14, do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    plain = LLMEngine(model, page_size=3, num_pages=128).generate(PROMPTS, params)
    assert [o.output_ids for o in plain] == ref
    # the compressed cache: one latent head of kv_lora + rope values per token and layer
    assert model.args.num_kv_heads == 1 and model.args.head_dim == 32 + 8
    spec = SpecEngine(model, DraftModelProposer(model), 3, page_size=3, num_pages=128)
    assert [o.output_ids for o in spec.generate(PROMPTS, params)] == ref
    assert spec.stats.metrics.acceptance_rate == 1.0


def test_precompute_stores_the_models_hidden_states(checkpoints, tmp_path):
    path, _ = checkpoints["lite"]
    model = load_model(path, dtype="float32", backend="torch")
    samples = [Sample(f"s{i}", p, [1] * len(p)) for i, p in enumerate(PROMPTS)]
    precompute(model, samples, tmp_path / "pc", tokenizer_fingerprint="t", chat_template_fingerprint="c",
               model_dir=path, data_info={}, shard_tokens=64, batch_tokens=64, progress=False)
    ds = PrecomputedDataset(tmp_path / "pc", split="all")
    for i in range(len(ds)):
        item = ds[i]
        ref = prefill_hidden(model, [item["input_ids"].tolist()]).hidden.to(torch.bfloat16)
        torch.testing.assert_close(item["hidden"].float(), ref.float(), rtol=0, atol=2e-2)


def test_eagle1_heads_and_dense_targets_with_moe_are_refused_clearly(checkpoints, tiny_checkpoints):
    with pytest.raises(ModelConfigError, match="DeepSeek-V2 target takes an mtp head"):
        build_head(HeadConfig(type="eagle1"), checkpoints["lite"][0])
    with pytest.raises(ValueError, match="needs a DeepSeek-V2 target"):
        build_head(HeadConfig(type="mtp", moe=True), tiny_checkpoints["llama"][0])


# --- an MTP head for a DeepSeek-V2 target: DeepSeek's own block (MLA + dense MLP, or MoE) -----------------------


@pytest.mark.parametrize("moe", [False, True])
def test_mtp_head_with_a_deepseek_block_trains_drafts_and_exports(checkpoints, tmp_path, moe):
    from safetensors import safe_open

    from mtp_train.export import export_head, load_export
    from mtp_train.heads import load_head, packed_shift, save_head
    from mtp_train.layers import AttentionMetadata
    from mtp_train.spec.proposers import HeadProposer

    path, _ = checkpoints["lite"]
    model = load_model(path, dtype="float32", backend="torch")
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="mtp", moe=moe, init="last_layer" if moe else "scratch"), path)
    assert type(head.layers[0].self_attn).__name__ == "MLAttention"
    # training forward = inference prefill over the head's paged (compressed) cache
    lens = [len(p) for p in PROMPTS]
    hidden = prefill_hidden(model, PROMPTS).hidden
    tokens = torch.tensor([t for p in PROMPTS for t in p])
    nxt = packed_shift(tokens, lens, 1)
    train = head.forward_train(hidden, nxt, lens)
    with torch.no_grad():
        inf = head(hidden, nxt, AttentionMetadata.build(lens)).hidden
    torch.testing.assert_close(inf, train, rtol=1e-5, atol=1e-5)
    # speculative decoding with it reproduces plain greedy decoding
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = [o.output_ids for o in LLMEngine(model, page_size=3, num_pages=128).generate(PROMPTS, params)]
    spec = SpecEngine(model, HeadProposer(head), 3, page_size=3, num_pages=128)
    assert [o.output_ids for o in spec.generate(PROMPTS, params)] == ref
    # deepseek-mtp export: DeepSeek's MLA names under model.layers.{L}., and it loads back to the same features
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", path, "deepseek-mtp", tmp_path / "ds")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    p = "model.layers.3."
    assert {f"{p}eh_proj.weight", f"{p}enorm.weight", f"{p}hnorm.weight", f"{p}shared_head.norm.weight",
            f"{p}shared_head.head.weight", f"{p}embed_tokens.weight", f"{p}self_attn.q_proj.weight",
            f"{p}self_attn.kv_a_proj_with_mqa.weight", f"{p}self_attn.kv_a_layernorm.weight",
            f"{p}self_attn.kv_b_proj.weight", f"{p}self_attn.o_proj.weight"} <= names
    assert (f"{p}mlp.experts.0.gate_proj.weight" in names) == moe and (f"{p}mlp.gate_proj.weight" in names) != moe
    back, again = load_export(out, path), load_head(tmp_path / "head", path)
    meta = AttentionMetadata.build(lens)
    with torch.no_grad():
        torch.testing.assert_close(back(hidden, nxt, meta).hidden, again(hidden, nxt, meta).hidden,
                                   rtol=1e-5, atol=1e-6)


def test_flashinfer_backend_is_refused_for_mla_and_auto_picks_torch(checkpoints):
    path, _ = checkpoints["lite"]
    assert type(load_model(path, backend="auto").attn).__name__ == "TorchBackend"
    with pytest.raises(ModelConfigError, match="torch backend"):
        load_model(path, backend="flashinfer")


def test_tensor_parallel_refuses_deepseek_clearly(checkpoints):
    from mtp_train.models.tensor_parallel import TPGroup, load_model_tp

    with pytest.raises(ModelConfigError, match="model.tp=1"):
        load_model_tp(checkpoints["lite"][0], TPGroup(0, 2))
