"""Tensor parallelism of MoE and MLA targets: TP = 2 (gloo, two processes) gives the hidden states, logits and
greedy tokens of TP = 1 for tiny Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3 configs with two all-reduces per decoder
layer (attention, then the MLP or the whole MoE block); without processes, each rank holds exactly its slices:
half of every divided field, the router, norms and MLA's latent path whole, an expert's bias on rank 0 only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.families import TPRules, args_from_hf_config, family_of
from mtp_train.models.tensor_parallel import (
    ReducedSum,
    RowParallelLinear,
    TPGroup,
    added_once,
    load_model_tp,
    local_args,
    rank_part,
)

sys.path.insert(0, str(Path(__file__).parent))
from _tp_worker import run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
WORKER = Path(__file__).parent / "_tp_worker.py"

_DS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1,
           max_position_embeddings=512, tie_word_embeddings=False)
# name → (transformers config class, fields): dims, heads and expert widths even; a dense layer and MoE layers each
HF_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=512, tie_word_embeddings=False,
        rms_norm_eps=1e-6)),
    # V2-Lite's plain q_proj, group-limited softmax routing, two shared experts
    "deepseek_v2": ("DeepseekV2Config", {**_DS, "q_lora_rank": None, "topk_method": "group_limited_greedy",
                                         "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5}),
    # V3's q LoRA (q_b_proj split by heads), sigmoid router with a correction bias over 2 of 4 groups, tied head
    "deepseek_v3": ("DeepseekV3Config", {**_DS, "q_lora_rank": 24, "n_group": 4, "topk_group": 2,
                                         "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                                         "tie_word_embeddings": True}),
}
# biases on the experts (added once over the group) and on o_proj: no released config has them, so our own model
BIASED = {**_DS, "model_type": "deepseek_v2", "q_lora_rank": 24, "mlp_bias": True, "attention_bias": True}
NAMES = [*HF_CONFIGS, "biased"]


def _save_hf(name: str, out: Path) -> Path:
    import transformers

    cls, fields = HF_CONFIGS[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**fields),
                                                       attn_implementation="eager")
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # a router with real preferences, so each rank's routing is really tested
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    hf.save_pretrained(out, safe_serialization=True)
    return out


def _save_biased(out: Path) -> Path:
    args = args_from_hf_config(BIASED, "biased")
    torch.manual_seed(0)
    model = family_of(args).model(args)
    tensors = {}
    for n, p in model.named_parameters():
        t = torch.rand_like(p) + 0.5 if n.endswith("norm.weight") else torch.randn_like(p) * 0.2
        tensors[n] = t.contiguous()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(BIASED))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_moe")
    out = {name: _save_hf(name, root / name) for name in HF_CONFIGS}
    out["biased"] = _save_biased(root / "biased")
    return out


@pytest.mark.slow
def test_tp2_equals_tp1_with_two_all_reduces_per_layer(folders, tmp_path):
    outs = {name: tmp_path / f"{name}.pt" for name in NAMES}
    argv = [str(a) for name in NAMES for a in (folders[name], outs[name])]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in NAMES:
        ref_model = load_model(folders[name], dtype="float32", backend="torch")
        ref, got = run(ref_model), torch.load(outs[name])
        torch.testing.assert_close(got["hidden"], ref["hidden"], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5, msg=name)
        assert got["tokens"] == ref["tokens"], name
        # the embedding's, then per layer o_proj's and the MLP's or the MoE block's: never one per expert
        assert got["all_reduces"] == 1 + 2 * ref_model.args.num_layers, name


@pytest.mark.slow
def test_gpt_oss_tp2_equals_tp1(tmp_path):
    """GPT-OSS's fused experts, sinks, biases and alternating windows under TP = 2: the hidden states, logits and
    greedy tokens of TP = 1, with one all-reduce for o_proj and one for the MoE block per layer."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                    num_experts_per_tok=2, sliding_window=5, max_position_embeddings=64,
                                    tie_word_embeddings=False, swiglu_limit=1.5)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("sinks") or n.endswith("bias"):
                p.normal_(0, 0.5)  # non-zero sinks and biases, so their slices and the rank-0 bias are tested
    folder, out = tmp_path / "gpt_oss", tmp_path / "gpt_oss.pt"
    hf.save_pretrained(folder, safe_serialization=True)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(folder), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref_model = load_model(folder, dtype="float32", backend="torch")
    ref, got = run(ref_model), torch.load(out)
    torch.testing.assert_close(got["hidden"], ref["hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    assert got["tokens"] == ref["tokens"]
    assert got["all_reduces"] == 1 + 2 * ref_model.args.num_layers


def _unwrapped(name: str) -> str:
    return name.replace(".inner.", ".")


def _is_partial_bias(name: str) -> bool:
    return name.endswith("down_proj.bias") and "experts." in name  # routed and shared


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_holds_its_slices(folders, name):
    """Both ranks' parameters, concatenated along the split dimension, are the TP = 1 model's; every split
    dimension is half the full one, and the rest (router, norms, the latent path) is whole on each rank."""
    full = load_model(folders[name], dtype="float32", backend="torch", cpu_prepack=False)
    ranks = [load_model_tp(folders[name], TPGroup(r, 2), dtype="float32", backend="torch", cpu_prepack=False)
             for r in (0, 1)]  # loading communicates nothing: no process group needed
    want = dict(full.named_parameters())
    got = [{_unwrapped(n): p for n, p in m.named_parameters()} for m in ranks]
    assert got[0].keys() == got[1].keys() == want.keys() - ({"lm_head.weight"} if full.args.tie_word_embeddings
                                                             else set())
    split = set()
    for n, p0 in got[0].items():
        w, p1 = want[n], got[1][n]
        assert p0.shape == p1.shape
        if p0.shape == w.shape:
            assert torch.equal(p0, w), n
            if _is_partial_bias(n):
                assert not p1.any(), n  # rank 1's copy is zeros: the block's all-reduce adds the bias once
            else:
                assert torch.equal(p1, w), n
            continue
        dim = next(d for d in range(w.dim()) if p0.shape[d] != w.shape[d])
        assert 2 * p0.shape[dim] == w.shape[dim], n
        split.add(n.split(".layers.")[-1].split(".", 1)[-1] if ".layers." in n else n)
        if "qkv_proj" not in n and "gate_up_proj" not in n:  # fused ones interleave their parts per rank
            torch.testing.assert_close(torch.cat([p0, p1], dim), w, rtol=0, atol=0, msg=n)
    args = full.args
    if args.model_type == "qwen3_moe":
        assert {"mlp.experts.0.gate_proj.weight", "mlp.experts.7.down_proj.weight",
                "self_attn.o_proj.weight"} <= split
        assert "mlp.gate.weight" not in split and "self_attn.q_norm.weight" not in split
    else:
        q = "self_attn.q_proj.weight" if args.q_lora_rank is None else "self_attn.q_b_proj.weight"
        assert {q, "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.shared_experts.up_proj.weight",
                "mlp.shared_experts.down_proj.weight", "mlp.experts.3.down_proj.weight"} <= split
        whole = {"self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "mlp.gate.weight",
                 "self_attn.q_a_proj.weight"}
        assert not whole & split
    loc = ranks[0].args
    assert loc.num_heads * 2 == args.num_heads and loc.moe_intermediate_size * 2 == args.moe_intermediate_size
    if args.model_type == "qwen3_moe":
        assert loc.kv_layout.num_kv_heads * 2 == args.kv_layout.num_kv_heads  # each rank caches its KV heads
    else:
        assert loc.kv_layout == args.kv_layout and args.kv_layout.latent  # and the whole latent row of MLA
        assert ranks[0].model.layers[1].self_attn.kv_b_proj.weight.shape == (
            2 * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_moe_blocks_reduce_once_and_dense_layers_per_projection(folders, name):
    model = load_model_tp(folders[name], TPGroup(0, 2), dtype="float32", backend="torch", cpu_prepack=False)
    dense, moe = model.model.layers[0], model.model.layers[1]
    assert isinstance(dense.mlp.down_proj, RowParallelLinear) and not isinstance(dense.mlp, ReducedSum)
    assert isinstance(moe.mlp, ReducedSum)
    for layer in (dense, moe):  # the modules that all-reduce: two per layer
        reducing = [m for m in layer.modules() if isinstance(m, RowParallelLinear | ReducedSum)]
        assert len(reducing) == 2
        assert isinstance(layer.self_attn.o_proj, RowParallelLinear)
    assert not any(isinstance(m, RowParallelLinear) for m in moe.mlp.modules())  # experts' down_proj: partial


def test_divisibility_is_checked_for_heads_and_expert_widths(folders):
    args = args_from_hf_config(json.loads((folders["deepseek_v3"] / "config.json").read_text()))
    with pytest.raises(ModelConfigError, match="num_heads=4"):
        local_args(args, 8)
    qwen = args_from_hf_config({**HF_CONFIGS["qwen3_moe"][1], "model_type": "qwen3_moe",
                                "moe_intermediate_size": 30})
    with pytest.raises(ModelConfigError, match="moe_intermediate_size=30 divisible by 4"):
        local_args(qwen, 4)


def test_fused_expert_tensors_opt_in_by_tensor_rules():
    """A family whose experts are fused tensors (GPT-OSS's (E, H, 2I) gate_up with interleaved gate / up columns,
    (E, I, H) down, their biases) opts in with `tensors` and `once` rules: each rank reads a contiguous run of
    intermediate units (pairs stay together), and the down bias is rank 0's."""
    rules = TPRules(column=("self_attn.q_proj",), row=("self_attn.o_proj",), divided=("intermediate_size",),
                    reduced=("mlp",), tensors=(("mlp.experts.gate_up_proj", 2), ("mlp.experts.gate_up_proj_bias", 1),
                                               ("mlp.experts.down_proj", 1)),
                    once=("mlp.experts.down_proj_bias",))
    layer = "model.layers.3."
    for rank in (0, 1):
        tp, lo, hi = TPGroup(rank, 2), 6 * rank, 6 * rank + 6
        assert rank_part(layer + "mlp.experts.gate_up_proj", (4, 8, 12), tp, rules) == (
            (slice(None), slice(None), slice(lo, hi)), 0)
        assert rank_part(layer + "mlp.experts.gate_up_proj_bias", (4, 12), tp, rules) == ((slice(None), slice(lo, hi)),
                                                                                          0)
        assert rank_part(layer + "mlp.experts.down_proj", (4, 12, 8), tp, rules) == ((slice(None), slice(lo, hi)), 0)
        assert rank_part(layer + "mlp.experts.down_proj_bias", (4, 8), tp, rules) == ((), 0)
        assert rank_part(layer + "mlp.router.weight", (4, 8), tp, rules) == ((), 0)
        assert rank_part(layer + "self_attn.q_proj.weight", (8, 8), tp, rules) == ((slice(4 * rank, 4 * rank + 4),), 0)
    assert added_once(layer + "mlp.experts.down_proj_bias", rules)
    assert not added_once(layer + "mlp.experts.down_proj", rules) and not added_once(layer + "mlp.router.bias", rules)
    # module rules: partial modules' biases are added once, the others' are not
    ds = family_of(args_from_hf_config(BIASED)).tp
    assert added_once(layer + "mlp.experts.5.down_proj.bias", ds)
    assert added_once(layer + "mlp.shared_experts.down_proj.bias", ds)
    assert not added_once(layer + "mlp.down_proj.bias", ds) and not added_once(layer + "mlp.experts.5.up_proj.bias", ds)
