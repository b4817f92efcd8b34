"""DeepSeek-V2 targets (MLA over a latent-only paged KV cache, decoupled RoPE, MoE): parity with transformers on tiny
random configs, paged decode = HF generate and = a full recompute, verify = single steps, the model in precompute and
speculative decoding, and MLA backend selection (FlashInfer's MLA kernels on CUDA, torch elsewhere)."""

from __future__ import annotations

import pytest
import torch

from mtp_train.config import HeadConfig
from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.heads import build_head
from mtp_train.models import ModelConfigError, load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import DraftModelProposer
from tests._family import assert_precompute_stores_hidden, save_random

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

    def router(name, t):
        if name.endswith("mlp.gate.weight"):
            t.normal_(0, 0.5)  # a router with real preferences

    root = tmp_path_factory.mktemp("ds")
    return {name: (root / name, save_random(transformers.DeepseekV2Config(**{**BASE, **over}), root / name, router))
            for name, over in CONFIGS.items()}


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
    assert_precompute_stores_hidden(load_model(path, dtype="float32", backend="torch"), path, PROMPTS, tmp_path / "pc")


def test_eagle_heads_and_dense_targets_with_moe_are_refused_clearly(checkpoints, tiny_checkpoints):
    with pytest.raises(ModelConfigError, match="DeepSeek-V2 target takes an mtp head"):
        build_head(HeadConfig(type="eagle1"), checkpoints["lite"][0])
    with pytest.raises(ModelConfigError, match="eagle3 heads take .*targets; a DeepSeek-V2 target"):
        build_head(HeadConfig(type="eagle3", draft_vocab_size=16), checkpoints["lite"][0])
    with pytest.raises(ValueError, match="head.moe=true needs a DeepSeek-V2 .*target"):
        build_head(HeadConfig(type="mtp", moe=True), tiny_checkpoints["llama"][0])


# --- an MTP head for a DeepSeek-V2 target: DeepSeek's own block (MLA + dense MLP, or MoE) -----------------------


@pytest.mark.parametrize("moe", [False, True])
def test_mtp_head_with_a_deepseek_block_trains_drafts_and_exports(checkpoints, tmp_path, moe):
    from safetensors import safe_open

    from mtp_train.export import export_head, load_export
    from mtp_train.head_types.chain import HeadProposer
    from mtp_train.heads import load_head, packed_shift, save_head
    from mtp_train.layers import AttentionMetadata

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
        inf = head(hidden, nxt, AttentionMetadata.build(lens), from_target=True).hidden
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
        torch.testing.assert_close(back(hidden, nxt, meta, from_target=True).hidden,
                                   again(hidden, nxt, meta, from_target=True).hidden,
                                   rtol=1e-5, atol=1e-6)


def test_mla_backend_selection_on_cpu(checkpoints):
    path, _ = checkpoints["lite"]
    assert type(load_model(path, backend="auto").attn).__name__ == "TorchMLA"
    assert type(load_model(path, backend="torch").attn).__name__ == "TorchMLA"
    with pytest.raises(ModelConfigError, match="DeepSeek-V2 \\(MLA\\): the flashinfer MLA backend needs a CUDA device"):
        load_model(path, backend="flashinfer")


# --- the latent-only cache: the engine's pools, paged decode and verify through the model -------------------------


def test_target_and_head_pools_hold_only_the_latent_rows(checkpoints):
    from mtp_train.engine import ModelRunner
    from mtp_train.head_types.chain import HeadProposer

    path, _ = checkpoints["lite"]
    model = load_model(path, dtype="float32", backend="torch")
    runner = ModelRunner.create(model, num_pages=10, page_size=3)
    assert runner.kv.layers[0].shape == (10, 3, 32 + 8)  # (num_pages, page_size, kv_lora + rope)
    assert len(runner.kv.layers) == 3
    # kv_cache_gb sizes the pool by (C + R) · 4 bytes per token and layer: half of a K head plus a V head
    per_token = 3 * (32 + 8) * 4
    assert ModelRunner.create(model, page_size=3, kv_cache_gb=per_token * 3 * 7 / 2**30).kv.num_pages == 7
    head = build_head(HeadConfig(type="mtp"), path)
    assert head.kv_shape[1].latent
    proposer = HeadProposer(head)
    proposer.bind(runner.kv)
    assert proposer.kv.layers[0].shape == (10, 3, 40) and len(proposer.kv.layers) == 1


def _decode_logits(model, prompts, steps, page_size=3):
    """Prefill `prompts` into pages, then teacher-force `steps` tokens one at a time: logits (steps, B, V)."""
    from mtp_train.engine import ModelRunner, Sequence

    runner = ModelRunner.create(model, num_pages=64, page_size=page_size)
    seqs = [Sequence.new(i, list(p)) for i, p in enumerate(prompts)]
    runner.run(seqs)
    out = []
    for j in range(steps):
        for i, s in enumerate(seqs):
            s.token_ids.append((17 * j + 5 * i + 3) % model.args.vocab_size)
        out.append(runner.run(seqs).logits)
    return torch.stack(out), seqs


@pytest.mark.parametrize("name", ["lite", "yarn"])
def test_paged_decode_over_pages_of_3_equals_a_full_recompute(checkpoints, name):
    path, _ = checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    steps = 6
    got, seqs = _decode_logits(model, PROMPTS, steps)
    for b, s in enumerate(seqs):
        n = len(PROMPTS[b])
        for j in range(steps):  # the whole sequence up to the fed token, without any cache
            hidden = prefill_hidden(model, [s.token_ids[: n + j + 1]]).hidden[-1:]
            torch.testing.assert_close(got[j, b], model.compute_logits(hidden)[0], rtol=1e-5, atol=1e-5)


def test_verify_of_several_new_tokens_equals_single_steps(checkpoints):
    from mtp_train.engine import ModelRunner, Sequence

    path, _ = checkpoints["full"]
    model = load_model(path, dtype="float32", backend="torch")
    new = [[7, 8, 9, 10], [11, 12], [13, 14, 15]]  # uneven: the per-sequence verify path
    runner = ModelRunner.create(model, num_pages=64, page_size=3)
    seqs = [Sequence.new(i, list(p)) for i, p in enumerate(PROMPTS)]
    runner.run(seqs)
    for s, t in zip(seqs, new):
        s.token_ids.extend(t)
    got = runner.run(seqs, logits="all").logits  # (Σ new, V)
    runner = ModelRunner.create(model, num_pages=64, page_size=3)
    seqs = [Sequence.new(i, list(p)) for i, p in enumerate(PROMPTS)]
    runner.run(seqs)
    want: list[list[torch.Tensor]] = [[] for _ in seqs]
    for j in range(max(map(len, new))):
        live = [b for b, t in enumerate(new) if j < len(t)]
        for b in live:
            seqs[b].token_ids.append(new[b][j])
        logits = runner.run([seqs[b] for b in live]).logits
        for i, b in enumerate(live):
            want[b].append(logits[i])
    torch.testing.assert_close(got, torch.cat([torch.stack(w) for w in want]), rtol=1e-5, atol=1e-5)


def test_deepseek_head_chained_training_equals_its_latent_cache_inference(checkpoints):
    """The unrolled chain (MLA through the generic chain attention) = draft steps over the head's latent pool."""
    from mtp_train.speculative.chain import inference_chain

    path, _ = checkpoints["lite"]
    model = load_model(path, dtype="float32", backend="torch")
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="mtp", moe=True, init="last_layer"), path).eval()
    lens = [len(p) for p in PROMPTS]
    hidden = prefill_hidden(model, PROMPTS).hidden
    tokens = torch.tensor([t for p in PROMPTS for t in p])
    with torch.no_grad():
        train_path = head.unroll(hidden, tokens, lens, 3, attention="chain")
    infer_path = inference_chain(head, hidden, tokens, lens, 3, kv_slots=64)
    for j, (x, y) in enumerate(zip(train_path, infer_path)):
        valid = torch.cat([torch.arange(n) < n - j - 1 for n in lens])  # rows with a real chain
        torch.testing.assert_close(y[valid], x[valid], rtol=1e-4, atol=1e-5, msg=f"step {j}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and flashinfer")
def test_flashinfer_mla_model_matches_torch_on_cuda(tmp_path):
    pytest.importorskip("flashinfer.mla")
    import transformers

    from mtp_train.engine import LLMEngine

    # FlashInfer's MLA widths (kv_lora 512, rope 64) on an otherwise tiny model, bf16
    over = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 8, "num_key_value_heads": 8,
            "q_lora_rank": None}
    cfg = transformers.DeepseekV2Config(**{**BASE, **over})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "ds")
    fi = load_model(tmp_path / "ds", dtype="bfloat16", device="cuda", backend="auto")
    ref = load_model(tmp_path / "ds", dtype="bfloat16", device="cuda", backend="torch")
    assert type(fi.attn).__name__ == "FlashInferMLA" and type(ref.attn).__name__ == "TorchMLA"
    torch.testing.assert_close(prefill_hidden(fi, PROMPTS).hidden.float(), prefill_hidden(ref, PROMPTS).hidden.float(),
                               rtol=3e-2, atol=3e-2)
    got, _ = _decode_logits(fi, PROMPTS, 8, page_size=16)
    want, _ = _decode_logits(ref, PROMPTS, 8, page_size=16)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    out = LLMEngine(fi, kv_cache_gb=0.5).generate(PROMPTS, params)
    assert all(len(o.output_ids) == 8 for o in out)


def test_tensor_parallel_refuses_a_tp_that_does_not_divide_the_heads(checkpoints):
    """TP = 2 against TP = 1 is tests/test_tp_moe.py's; tp = 8 over 4 heads is refused naming them."""
    from mtp_train.models.tensor_parallel import TPGroup, load_model_tp

    with pytest.raises(ModelConfigError, match="num_heads=4 divisible by 8"):
        load_model_tp(checkpoints["lite"][0], TPGroup(0, 8))
