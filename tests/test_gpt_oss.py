"""GPT-OSS targets (attention sinks, alternating sliding / full layers, q/k/v/o biases, YaRN, MoE with the clamped
SwiGLU and biases): parity with transformers on tiny random configs (every hidden state and logits, prefill and
paged decode / verify steps, with the native CPU kernels on and off), paged greedy decoding = HF generate,
speculative decoding with the target as its own draft (greedy = plain), precompute, mtp / eagle3 heads trained a
few steps on it, and the refusals by name (MXFP4, flashinfer, bad layer types)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from mtp_train.config import HeadConfig
from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.heads import build_head
from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.families import args_from_hf_config
from mtp_train.models.families.gpt_oss import Experts, clamped_swiglu
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import DraftModelProposer
from tests._family import assert_head_trains_and_drafts_losslessly, assert_precompute_stores_hidden, save_random

pytestmark = pytest.mark.usefixtures("one_thread")

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
            max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_parameters=YARN,
            swiglu_limit=1.5)  # a low limit so that the clamps bite on tiny random activations
CONFIGS = {
    # transformers' default layer types: sliding, full, sliding, full
    "alternating": {},
    # full first, two sliding layers in a row, top-3 routing, tied embeddings, MHA
    "mixed": {"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
              "num_experts_per_tok": 3, "tie_word_embeddings": True, "num_key_value_heads": 4, "sliding_window": 3},
}
PROMPTS = [[3, 17, 42, 9, 100, 7, 8, 200, 13], [5, 6], list(range(30, 52))]
MODES = [pytest.param(True, id="native"), pytest.param(False, id="torch")]


def _kernels(native: bool):
    if native and not cpu_kernels.available():
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    return nullcontext() if native else cpu_kernels.disabled()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers

    def router(name, t):
        if name.endswith("sinks"):
            t.normal_(0, 1.5)  # sinks that take a real share of the softmax
        elif name.endswith("bias"):
            t.normal_(0, 0.3)
        elif "experts" in name or name.endswith("router.weight"):
            t.normal_(0, 0.3)  # experts and a router with real preferences

    root = tmp_path_factory.mktemp("gptoss")
    return {name: (root / name, save_random(transformers.GptOssConfig(**{**BASE, **over}), root / name, router))
            for name, over in CONFIGS.items()}


def test_config_is_parsed_as_transformers_reads_it(checkpoints):
    path, hf = checkpoints["alternating"]
    model = load_model(path, dtype="float32", backend="torch")
    a = model.args
    assert a.layer_windows == [5, None, 5, None] and a.sliding_window is None
    assert (a.qkv_bias, a.o_bias, a.num_experts, a.num_experts_per_tok) == (True, True, 8, 2)
    assert a.rope.rope_type == "yarn" and model.rotary.attention_scaling != 1.0
    assert [layer.self_attn.window for layer in model.model.layers] == [5, None, 5, None]
    mixed = load_model(checkpoints["mixed"][0], dtype="float32", backend="torch").args
    assert mixed.layer_windows == [None, 3, 3, None]


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_hidden_states_and_logits_match_transformers(checkpoints, name, native):
    path, hf = checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    n = model.args.num_layers
    for ids in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True)
        with _kernels(native):
            out = prefill_hidden(model, [ids], hidden_layers=range(n + 1))
        for j in range(n + 1):
            torch.testing.assert_close(out.layers[j], ref.hidden_states[j][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.compute_logits(out.hidden), ref.logits[0], rtol=1e-5, atol=1e-5)
    with _kernels(native):  # the prompts packed into one prefill step: each attends within itself
        packed = prefill_hidden(model, PROMPTS).hidden.split([len(p) for p in PROMPTS])
    for ids, got in zip(PROMPTS, packed):
        with torch.no_grad():
            want = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_verify_and_decode_steps_match_transformers(checkpoints, name, native):
    """Prefill a prefix into scattered pages, verify a chunk on it, then decode two sequences token by token:
    every step's logits equal transformers' over the whole sequence (windows shorter than the prefixes)."""
    path, hf = checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    seqs = [PROMPTS[0] + PROMPTS[2][:6], PROMPTS[2]]  # 15 and 22 tokens
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    ps, pages = 3, 32
    pools = [torch.zeros(pages, *model.args.kv_layout.page_shape(ps)) for _ in range(model.args.num_layers)]
    tables = [list(range(0, 16)), list(range(31, 15, -1))]  # scattered, disjoint
    done = [0, 0]

    def step(news: list[int]) -> list[torch.Tensor]:
        kv = [d + q for d, q in zip(done, news)]
        meta = AttentionMetadata.build(news, kv, tables, ps)
        ids = torch.tensor([t for s, d, q in zip(seqs, done, news) for t in s[d:d + q]])
        with _kernels(native), torch.no_grad():
            out = model(ids, meta, pools, logits_indices=torch.arange(len(ids)))
        done[:] = kv
        return list(out.logits.split(news))

    for got, want, lo in zip(step([7, 9]), ref, [0, 0]):  # prefill
        torch.testing.assert_close(got, want[lo:lo + got.shape[0]], rtol=1e-5, atol=1e-5)
    for news in ([4, 6], [1, 1], [1, 1], [2, 1]):  # verify (non-uniform, uniform), decode, mixed
        los = list(done)
        for got, want, lo in zip(step(news), ref, los):
            torch.testing.assert_close(got, want[lo:lo + got.shape[0]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_decode_and_speculative_decoding_equal_transformers_generate(checkpoints, name):
    path, hf = checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=14, do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    plain = LLMEngine(model, page_size=3, num_pages=128).generate(PROMPTS, params)
    assert [o.output_ids for o in plain] == ref
    spec = SpecEngine(model, DraftModelProposer(model), 3, page_size=3, num_pages=128)
    assert [o.output_ids for o in spec.generate(PROMPTS, params)] == ref
    assert spec.stats.metrics.acceptance_rate == 1.0


def test_experts_equal_transformers_experts_token_by_token():
    """Our grouped clamped-SwiGLU experts against transformers' module on the same fused tensors."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(**{**BASE, "swiglu_limit": 0.5})
    torch.manual_seed(2)
    ref = GptOssExperts(cfg).double()
    ours = Experts(args_from_hf_config({**cfg.to_dict(), "model_type": "gpt_oss"})).double()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.normal_(0, 0.5)
            getattr(ours, n).copy_(p)
    x = torch.randn(6, 64, dtype=torch.float64)
    ids = torch.tensor([[0, 2], [2, 0], [3, 2], [0, 3], [2, 3], [0, 2]])  # repeated experts, most never hit
    w = torch.rand(6, 2, dtype=torch.float64)
    from mtp_train.models.families.qwen3_moe import grouped_experts

    want = ref(x, ids, w)
    torch.testing.assert_close(grouped_experts(x, w.float(), ids, ours), want, rtol=1e-6, atol=1e-6)
    gate, up = torch.tensor([-9.0, 0.2, 9.0]), torch.tensor([-9.0, 0.1, 9.0])  # the clamps, both sides
    torch.testing.assert_close(clamped_swiglu(gate, up, 1.702, 7.0),
                               (up.clamp(-7, 7) + 1) * gate.clamp(max=7) * torch.sigmoid(1.702 * gate.clamp(max=7)))


def test_precompute_stores_the_models_hidden_states(checkpoints, tmp_path):
    path, _ = checkpoints["mixed"]
    assert_precompute_stores_hidden(load_model(path, dtype="float32", backend="torch"), path, PROMPTS, tmp_path / "pc")


@pytest.mark.parametrize("head_cfg", [HeadConfig(type="mtp"), HeadConfig(type="mtp", moe=True),
                                      HeadConfig(type="eagle1"),
                                      HeadConfig(type="eagle3", draft_vocab_size=64, aux_layers=[1, 2, 3])],
                         ids=["mtp", "mtp-moe", "eagle1", "eagle3"])
def test_heads_train_on_it_and_draft_losslessly(checkpoints, head_cfg):
    path, _ = checkpoints["alternating"]
    model = load_model(path, dtype="float32", backend="torch")
    torch.manual_seed(0)
    head = build_head(head_cfg, path, dtype="float32")
    if head_cfg.type == "mtp":
        block = head.layers[0]
        assert block.self_attn.window is None and block.self_attn.sinks is None  # full attention, no sinks
        assert type(block.mlp).__name__ == ("MoE" if head_cfg.moe else "DenseMLP")
        if head_cfg.moe:  # the target's layer but for its sinks
            assert block.state_dict().keys() == model.model.layers[0].state_dict().keys() - {"self_attn.sinks"}
    assert_head_trains_and_drafts_losslessly(model, head, PROMPTS)


def test_flashinfer_and_mxfp4_and_bad_layer_types_are_refused_by_name(checkpoints):
    path, _ = checkpoints["alternating"]
    with pytest.raises(ModelConfigError, match="attention sinks.*backend=torch"):
        load_model(path, dtype="float32", backend="flashinfer")
    cfg = {**BASE, "model_type": "gpt_oss", "rope_parameters": YARN}
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with pytest.raises(ModelConfigError, match="quant_method='mxfp4'.*bf16 copy"):
        args_from_hf_config({**cfg, "quantization_config": mxfp4}, "x/config.json")
    with pytest.raises(ModelConfigError, match="layer_types must list 4"):
        args_from_hf_config({**cfg, "layer_types": ["full_attention", "chunked_attention"] * 2}, "x/config.json")
    with pytest.raises(ModelConfigError, match="sliding_window=None"):
        args_from_hf_config({**cfg, "sliding_window": None}, "x/config.json")
    with pytest.raises(ModelConfigError, match="num_experts_per_tok=9"):
        args_from_hf_config({**cfg, "num_experts_per_tok": 9}, "x/config.json")


def test_bfloat16_is_close_to_transformers_and_decodes(checkpoints):
    """bf16 weights (the released model's compute dtype; the sink softmax runs in float32) against transformers in
    float32: bf16 rounding only (a router near-tie may send one token elsewhere, hence mean and argmax checks)."""
    path, hf = checkpoints["alternating"]
    model = load_model(path, dtype="bfloat16", backend="torch")
    ids = PROMPTS[2]
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    out = prefill_hidden(model, [ids]).hidden
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref.hidden_states[-1][0]).abs()
    assert float(err.mean()) < 0.03 * float(ref.hidden_states[-1][0].abs().mean()) + 0.02, float(err.mean())
    agree = model.compute_logits(out).float().argmax(-1) == ref.logits[0].argmax(-1)
    assert float(agree.float().mean()) >= 0.9
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outs = LLMEngine(model, page_size=3, num_pages=64).generate(PROMPTS, params)
    assert [len(o.output_ids) for o in outs] == [6] * len(PROMPTS)
