"""Block-scaled FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 layout): tiny random models quantised here, then loaded.

Each projection weight W (out, in) is quantised by this file's own quantiser into float8_e4m3fn with a float32
`weight_scale_inv` per (bm, bn) block (amax / 448); the sizes leave partial blocks at the edges and put the TP = 2
slice boundaries inside blocks. The reference is the same arithmetic written independently (the scale grid
expanded to the weight's shape): the loader's weights must equal it exactly, and the model's logits must equal
transformers' on a folder holding those dequantised weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_train.engine import prefill_hidden
from mtp_train.heads.frozen import read_decoder_layer
from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.tensor_parallel import TPGroup, load_model_tp

pytestmark = pytest.mark.usefixtures("one_thread")
WORKER = Path(__file__).parent / "_tp_worker.py"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
PROMPTS = [[3, 17, 42, 9, 100, 7], list(range(20, 41)), [250, 7, 1]]

# hidden 200, q rows 160, k/v rows 80, MLP 320: partial 128-blocks everywhere, TP halves (80, 40, 100, 160) inside
# blocks of 128 and of 32 × 48; 40 × 40 divides every shape (what transformers' own dequantiser needs).
SHAPE = dict(vocab_size=256, hidden_size=200, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=40, max_position_embeddings=256, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"moe_intermediate_size": 72, "num_experts": 4, "num_experts_per_tok": 2,
                                     "norm_topk_prob": True}),
    # MLA (kv_a_proj_with_mqa: 88 rows) with the V3 router, shared experts and a dense first layer
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "head_dim": None, "moe_intermediate_size": 72,
                                         "kv_lora_rank": 72, "qk_nope_head_dim": 24, "qk_rope_head_dim": 16,
                                         "v_head_dim": 24, "q_lora_rank": 56, "n_routed_experts": 4,
                                         "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
                                         "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
                                         "routed_scaling_factor": 2.5}),
}
# variant → (weight_block_size, scale_fmt)
VARIANTS = {"128": ([128, 128], "float"), "32x48": ([32, 48], "float"), "ue8m0": ([128, 128], "ue8m0"),
            "40x40": ([40, 40], "float")}


def quantize(w: torch.Tensor, block: list[int], ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w (r, c) → (float8_e4m3fn (r, c), scale_inv (ceil(r / bm), ceil(c / bn)) float32), block by block."""
    bm, bn = block
    r, c = w.shape
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-r // bm), -(-c // bn))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float()
            amax = float(blk.abs().max())
            scale = amax / FP8_MAX if amax > 0 else 1.0
            if ue8m0:  # a power of two at least as large, so nothing clips
                scale = 2.0 ** torch.ceil(torch.log2(torch.tensor(scale))).item()
            s[i, j] = scale
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (blk / scale).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
    return q, s


def dequantize_reference(q: torch.Tensor, s: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The real weight: q.float() · the scale of each element's block (grid expanded, edges cut), float32."""
    r, c = q.shape
    return q.float() * s.repeat_interleave(block[0], 0)[:r].repeat_interleave(block[1], 1)[:, :c]


def is_projection(name: str) -> bool:
    """What the releases quantise: attention and MLP / expert projections (not embeddings, norms, router, head)."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def write_shards(dst: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Two shards and an index; every scale goes to the second, so a weight and its scale live in different files."""
    first = {n: t for n, t in tensors.items() if not n.endswith("_scale_inv")}
    second = {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    for fname, part in (("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", second)):
        save_file({n: t.contiguous() for n, t in part.items()}, str(dst / fname))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in second})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def make_fp8_pair(src: Path, root: Path, variant: str) -> tuple[Path, Path]:
    """From an HF folder `src`: (FP8 folder, reference folder holding the dequantised weights in float32)."""
    block, scale_fmt = VARIANTS[variant]
    fp8_dir, ref_dir = root / f"fp8-{variant}", root / f"ref-{variant}"
    state = load_file(str(src / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not is_projection(name):
            stored[name], ref[name] = t, t.float()
            continue
        q, s = quantize(t, block, ue8m0=scale_fmt == "ue8m0")
        ref[name] = dequantize_reference(q, s, block)
        # ue8m0 scales as the exponent bytes (2 ** (byte - 127)) that MXFP8-style checkpoints store
        stored[name], stored[name + "_scale_inv"] = q, (torch.log2(s) + 127).to(torch.uint8) if scale_fmt == "ue8m0" \
            else s
    cfg = json.loads((src / "config.json").read_text())
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(ref, str(ref_dir / "model.safetensors"))
    write_shards(fp8_dir, stored)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": block, "scale_fmt": scale_fmt,
                                  "modules_to_not_convert": ["lm_head"]}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    return fp8_dir, ref_dir


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{"family/variant": (FP8 folder, reference folder)} for every family and block variant."""
    import transformers

    out = {}
    for fam, (cls_name, over) in FAMILIES.items():
        torch.manual_seed(0)
        cfg = getattr(transformers, cls_name)(**{k: v for k, v in {**SHAPE, **over}.items() if v is not None})
        hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif n.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)  # a router with real preferences
        root = tmp_path_factory.mktemp(f"fp8-{fam}")
        hf.save_pretrained(root / "src", safe_serialization=True)
        for variant in VARIANTS:
            out[f"{fam}/{variant}"] = make_fp8_pair(root / "src", root, variant)
    return out


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    a, b = params(got), params(want)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("key", ["llama/128", "llama/32x48", "llama/ue8m0", "qwen3_moe/128"])
def test_weights_are_the_dequantised_reference_exactly(folders, key, dtype):
    fp8_dir, ref_dir = folders[key]
    got = load_model(fp8_dir, dtype=dtype, backend="torch", cpu_prepack=False)
    want = load_model(ref_dir, dtype=dtype, backend="torch", cpu_prepack=False)  # fused the same way
    assert_same_weights(got, want)
    # the weights really went through FP8: near the original, not equal to it
    orig = load_file(str(fp8_dir.parent / "src" / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
    deq = load_file(str(ref_dir / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
    assert not torch.equal(deq, orig)
    torch.testing.assert_close(deq, orig, rtol=0.07, atol=1e-6)


@pytest.mark.parametrize("key", ["llama/32x48", "qwen3_moe/128"])
def test_a_heads_init_layer_is_read_dequantised(folders, key):
    """`read_decoder_layer` (a head's init from the target's last layer) dequantises like the full loader."""
    fp8_dir, ref_dir = folders[key]
    got, want = read_decoder_layer(fp8_dir, -1, "float32"), read_decoder_layer(ref_dir, -1, "float32")
    assert got.keys() == want.keys() and not any(n.endswith("_scale_inv") for n in got)
    assert all(torch.equal(got[n], want[n]) for n in got)


@pytest.mark.parametrize("key", ["llama/128", "llama/32x48", "qwen3_moe/128",
                                 "deepseek_v3/128"])
def test_logits_equal_transformers_on_the_dequantised_weights(folders, key):
    import transformers

    fp8_dir, ref_dir = folders[key]
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    model = load_model(fp8_dir, dtype="float32", backend="torch")
    for ids in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        out = prefill_hidden(model, [ids])
        torch.testing.assert_close(model.compute_logits(out.hidden), ref, rtol=1e-5, atol=1e-5)


def test_transformers_reads_the_same_weights_from_the_fp8_folder(folders):
    """transformers' own FP8 loader (dequantize=True; its dequantiser needs blocks that divide every shape)
    reads the folder this file writes as the project's loader does: the layout is the releases' layout."""
    import transformers

    fp8_dir, ref_dir = folders["llama/40x40"]
    qc = transformers.FineGrainedFP8Config(weight_block_size=(40, 40), dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32, quantization_config=qc)
    ref = load_file(str(ref_dir / "model.safetensors"))
    got = hf.state_dict()
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["128", "32x48"])
def test_tp_ranks_dequantise_exactly_their_slices(folders, variant):
    """Each TP = 2 rank's weights from the FP8 folder equal its weights from the dequantised folder: slices cut
    inside blocks (q rows at 80, o columns at 100, down columns at 160) take the right scales."""
    fp8_dir, ref_dir = folders[f"llama/{variant}"]
    for rank in (0, 1):
        tp = TPGroup(rank, 2)  # loading communicates nothing: no process group needed to read a rank's slices
        got = load_model_tp(fp8_dir, tp, dtype="float32", backend="torch", cpu_prepack=False)
        want = load_model_tp(ref_dir, tp, dtype="float32", backend="torch", cpu_prepack=False)
        assert_same_weights(got, want)
        assert got.model.layers[0].self_attn.qkv_proj.weight.shape == (80 + 40 + 40, 200)


@pytest.mark.parametrize("key", ["qwen3_moe/32x48", "deepseek_v3/128", "deepseek_v3/32x48"])
def test_tp_ranks_of_moe_and_mla_targets_dequantise_exactly_their_slices(folders, key):
    """Experts' halves (36 of 72 rows / columns) and MLA's head rows (kv_b_proj at 96 of 192) cut inside blocks."""
    fp8_dir, ref_dir = folders[key]
    for rank in (0, 1):
        tp = TPGroup(rank, 2)
        assert_same_weights(load_model_tp(fp8_dir, tp, dtype="float32", backend="torch", cpu_prepack=False),
                            load_model_tp(ref_dir, tp, dtype="float32", backend="torch", cpu_prepack=False))


@pytest.mark.slow
def test_tp2_logits_equal_tp1_on_the_fp8_folder(folders, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from _tp_worker import run

    fp8_dir, _ = folders["llama/128"]
    ref = run(load_model(fp8_dir, dtype="float32", backend="torch"))
    out = tmp_path / "tp2.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(fp8_dir), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    assert got["tokens"] == ref["tokens"]


def edited_copy(src: Path, dst: Path, quant_edit: dict | None = None, drop: str | None = None) -> Path:
    """A copy of FP8 folder `src` with its quantization_config edited (None values delete the whole config) and
    optionally one tensor dropped from the shards."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if quant_edit is not None:
        cfg["quantization_config"].update(quant_edit)
        if quant_edit.get("delete"):
            del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        tensors = {}
        for f in dst.glob("*.safetensors"):
            tensors.update(load_file(str(f)))
            f.unlink()
        del tensors[drop]
        write_shards(dst, tensors)
    return dst


SCALE = "model.layers.1.mlp.up_proj.weight_scale_inv"


@pytest.mark.parametrize("edit, drop, match", [
    ({"quant_method": "gptq"}, None, r"quantization_config\.quant_method='gptq' cannot be loaded"),
    ({"fmt": "e5m2"}, None, r"quantization_config\.fmt='e5m2' is not supported"),
    ({"activation_scheme": "static"}, None, r"quantization_config\.activation_scheme='static'"),
    ({"weight_block_size": None}, None, r"quantization_config\.weight_block_size=None"),
    ({"scale_fmt": "e4m3"}, None, r"quantization_config\.scale_fmt='e4m3'"),
    ({"weight_block_size": [64, 64]}, None,
     r"weight_scale_inv has shape \(2, 3\), but quantization_config\.weight_block_size \[64, 64\] implies \(4, 5\)"),
    ({"delete": True}, None, r"no quantization_config"),
    (None, SCALE, r"model\.layers\.1\.mlp\.up_proj\.weight is F8_E4M3 but the checkpoint lacks its scale "
                  r"model\.layers\.1\.mlp\.up_proj\.weight_scale_inv"),
    (None, "model.layers.1.mlp.up_proj.weight", r"scale .*up_proj\.weight_scale_inv has no weight"),
])
def test_refusals_name_the_key_or_tensor(folders, tmp_path, edit, drop, match):
    fp8_dir, _ = folders["llama/128"]
    bad = edited_copy(fp8_dir, tmp_path / "bad", edit, drop)
    with pytest.raises(ModelConfigError, match=match):
        load_model(bad, dtype="float32")
    with pytest.raises(ModelConfigError, match=match):  # checked from the config and headers, on TP alike
        load_model_tp(bad, TPGroup(0, 2), dtype="float32")
