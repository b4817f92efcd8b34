"""A DeepSeek-V3 target's own MTP layer (`num_nextn_predict_layers`, stored as `model.layers.{L}.*`): the target still
loads (and matches transformers, which ignores those keys), `head.init=target_mtp` builds an mtp head equal to an
independent forward of that layer (plain torch norms and eh_proj, transformers' own DeepseekV3DecoderLayer), the
refusals name the key, and `mtp-export format=deepseek-mtp stitch=TARGET` writes a loadable copy of the target with
the fine-tuned layer in a new shard and every other tensor referenced through links, not copied."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open
from safetensors.torch import save_file

from mtp_train.cli.export import export_main
from mtp_train.config import CONF_DIR, HeadConfig, register_configs
from mtp_train.export import LayoutError, stitch, stitch_head, verify_stitched
from mtp_train.export.exporter import export_digest
from mtp_train.export.stitch import INDEX, NEW_SHARD, SINGLE_LINK
from mtp_train.heads import build_head, packed_shift, save_head
from mtp_train.layers import AttentionMetadata
from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.fingerprint import weights_fingerprint

pytestmark = pytest.mark.usefixtures("one_thread")

L = 2  # decoder layers of the tiny target: its MTP layer is model.layers.2.*
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=L,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
              max_position_embeddings=512, tie_word_embeddings=False)
PREFIX = f"model.layers.{L}."
SEQS = [[3, 17, 42, 9, 100, 7, 8, 200, 13], [5, 6], list(range(30, 43))]
LAYOUTS = ("sharded", "own-shard", "single")  # MTP tensors in the last shard | in a shard of their own | one file


def _tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _mtp_layer(block: dict[str, torch.Tensor], embed: torch.Tensor, lm_head: torch.Tensor) -> dict[str, torch.Tensor]:
    """Random tensors of a DeepSeek MTP layer: the block's names and shapes (from a target MoE layer), the
    norms, eh_proj and the embedding / lm_head copies, as the release stores them."""
    g = torch.Generator().manual_seed(7)
    h = embed.shape[1]
    out = {}
    for name, t in block.items():
        if name.endswith("norm.weight"):
            out[name] = torch.empty(t.shape).uniform_(0.5, 1.5, generator=g)
        elif name.endswith("e_score_correction_bias"):
            out[name] = torch.randn(t.shape, generator=g) * 0.3
        elif name.endswith("mlp.gate.weight"):
            out[name] = torch.randn(t.shape, generator=g) * 0.5  # a router with real preferences
        else:
            out[name] = torch.randn(t.shape, generator=g) * float(t.std())
    out.update({"enorm.weight": torch.empty(h).uniform_(0.5, 1.5, generator=g),
                "hnorm.weight": torch.empty(h).uniform_(0.5, 1.5, generator=g),
                "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
                "shared_head.norm.weight": torch.empty(h).uniform_(0.5, 1.5, generator=g),
                "shared_head.head.weight": lm_head.clone(), "embed_tokens.weight": embed.clone()})
    return {PREFIX + k: v for k, v in out.items()}


def _write_target(hf, path, layout):
    """Save `hf` to `path`, then add an MTP layer's tensors to its safetensors and index, and
    num_nextn_predict_layers: 1 to config.json. Returns the added tensors (full names)."""
    sharded = layout != "single"
    hf.save_pretrained(path, safe_serialization=True, **({"max_shard_size": "200KB"} if sharded else {}))
    (path / "tokenizer_config.json").write_text('{"model_max_length": 512}\n')  # stands for the tokenizer files
    files = ({n: path / f for n, f in json.loads((path / INDEX).read_text())["weight_map"].items()} if sharded
             else {n: path / "model.safetensors" for n in _tensors(path / "model.safetensors")})
    state = {n: t for f in set(files.values()) for n, t in _tensors(f).items()}
    block = {n[len(f"model.layers.{L - 1}."):]: t for n, t in state.items() if n.startswith(f"model.layers.{L - 1}.")}
    mtp = _mtp_layer(block, state["model.embed_tokens.weight"], state["lm_head.weight"])
    if layout == "own-shard":
        shard = path / "model-99999-of-99999.safetensors"
        save_file(mtp, str(shard), metadata={"format": "pt"})
    else:  # into the shard that ends the checkpoint, beside the tensors it already holds
        shard = files["lm_head.weight"]
        save_file({**_tensors(shard), **mtp}, str(shard), metadata={"format": "pt"})
    if sharded:
        index = json.loads((path / INDEX).read_text())
        index["weight_map"].update(dict.fromkeys(mtp, shard.name))
        (path / INDEX).write_text(json.dumps(index, indent=2))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}, indent=2))
    return mtp


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """{layout: (folder, MTP tensors)} of one random tiny DeepSeek-V3 with an MTP layer, plus "plain": the same
    model as transformers saves it (no MTP tensors) and "hf": the transformers model."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**CONFIG),
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    root = tmp_path_factory.mktemp("ds3-mtp")
    out = {layout: (root / layout, _write_target(hf, root / layout, layout)) for layout in LAYOUTS}
    hf.save_pretrained(root / "plain", safe_serialization=True)
    out["plain"], out["hf"] = (root / "plain", {}), hf
    return out


def _packed():
    ids = torch.tensor([t for s in SEQS for t in s])
    lens = [len(s) for s in SEQS]
    return ids, lens


def _hidden(hf, seqs=SEQS):
    """(T, H) the target's last hidden state (after the final norm) of the packed sequences."""
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0] for s in seqs])


def _rms(x, w, eps):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w


def reference(raw, hf, hidden, next_tokens, lens):
    """The MTP layer's forward written out from its raw tensors `raw` (names without the prefix), sequence by
    sequence with causal attention at positions 0..n-1: features (T, H) and logits (T, V)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RotaryEmbedding,
    )

    cfg, eps = hf.config, hf.config.rms_norm_eps
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=L).eval()  # layer_idx >= first_k_dense_replace: MoE
    block = {k: v for k, v in raw.items()
             if k.split(".")[0] in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")}
    experts = range(cfg.n_routed_experts)
    own = {k: v for k, v in block.items() if not k.startswith("mlp.experts.")}
    # transformers keeps the experts as (E, 2I, H) gate|up and (E, H, I) down tensors
    own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([block[f"mlp.experts.{e}.{w}_proj.weight"]
                                                              for w in ("gate", "up")]) for e in experts])
    own["mlp.experts.down_proj"] = torch.stack([block[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    layer.load_state_dict(own, strict=True)
    rotary = DeepseekV3RotaryEmbedding(cfg)
    embed, lm_head = raw["embed_tokens.weight"], raw["shared_head.head.weight"]
    feats = []
    with torch.no_grad():
        for h, t in zip(hidden.split(lens), next_tokens.split(lens), strict=True):
            n = len(t)
            x = torch.cat([_rms(embed[t], raw["enorm.weight"], eps), _rms(h, raw["hnorm.weight"], eps)], -1)
            x = (x @ raw["eh_proj.weight"].T)[None]  # (1, n, H)
            pos = torch.arange(n)[None]
            mask = torch.full((1, 1, n, n), float("-inf")).triu(1)
            y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
            feats.append(_rms(y[0], raw["shared_head.norm.weight"], eps))
    f = torch.cat(feats)
    return f, f @ lm_head.T


# --- the target loads with its MTP layer ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_target_with_an_mtp_layer_loads_and_matches_transformers(target, layout):
    import transformers

    path, mtp = target[layout]
    hf = target["hf"]
    ours = load_model(path, dtype="float32", backend="torch")
    assert not any(n.startswith(PREFIX) for n, _ in ours.named_parameters())
    ids = torch.tensor([SEQS[0]])
    # transformers reads the folder too, and reports the MTP tensors (its expert names fused) as unused, only them
    again, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                    attn_implementation="eager")
    unused = set(info["unexpected_keys"])
    assert all(k.startswith(PREFIX) for k in unused) and not info["missing_keys"]
    assert {k for k in mtp if ".experts." not in k} <= unused
    with torch.no_grad():
        want, theirs = hf(ids).logits[0], again.eval()(ids).logits[0]
    torch.testing.assert_close(theirs, want, rtol=0, atol=0)
    meta = AttentionMetadata.build([ids.shape[1]])
    with torch.no_grad():
        got = ours(ids[0], meta, logits_indices=torch.arange(ids.shape[1])).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if layout == "sharded":  # the tensor-parallel loader skips them too (a group of one here)
        from mtp_train.models.tensor_parallel import TPGroup, load_model_tp

        tp = load_model_tp(path, TPGroup(0, 1), dtype="float32", backend="torch")
        with torch.no_grad():
            tp_logits = tp(ids[0], meta, logits_indices=torch.arange(ids.shape[1])).logits
        torch.testing.assert_close(tp_logits, got, rtol=1e-5, atol=1e-5)


def test_loader_ignores_only_the_declared_mtp_layers(target, tmp_path):
    path, _ = target["single"]
    state = _tensors(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    # no MTP layer declared: its tensors are unexpected, as any other would be
    (tmp_path / "none").mkdir()
    save_file(state, str(tmp_path / "none" / "model.safetensors"))
    (tmp_path / "none" / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(ModelConfigError, match=rf"unexpected tensor '{PREFIX}"):
        load_model(tmp_path / "none")
    # one declared: a tensor of a second one is still refused
    (tmp_path / "extra").mkdir()
    save_file({**state, f"model.layers.{L + 1}.enorm.weight": state[PREFIX + "enorm.weight"].clone()},
              str(tmp_path / "extra" / "model.safetensors"))
    (tmp_path / "extra" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=rf"unexpected tensor 'model.layers.{L + 1}.enorm.weight'"):
        load_model(tmp_path / "extra")


# --- head.init=target_mtp ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["sharded", "own-shard"])
def test_initialised_head_equals_a_reference_forward_of_the_mtp_layer(target, layout):
    path, mtp = target[layout]
    hf = target["hf"]
    head = build_head(HeadConfig(type="mtp", moe=True, init="target_mtp"), path, dtype="float32").eval()
    raw = {k[len(PREFIX):]: v for k, v in mtp.items()}
    assert torch.equal(head.fc.weight, raw["eh_proj.weight"]) and torch.equal(head.norm.weight,
                                                                            raw["shared_head.norm.weight"])
    ids, lens = _packed()
    hidden = _hidden(hf)
    nxt = packed_shift(ids, lens, 1)  # row i reads t_{i+1} (the last row of a sequence: token 0)
    want_f, want_l = reference(raw, hf, hidden, nxt, lens)
    with torch.no_grad():
        f = head.forward_train(hidden, nxt, lens)
        logits = head.compute_logits(f)
        out = head(hidden, nxt, AttentionMetadata.build(lens), from_target=True, logits_indices=torch.arange(len(ids)))
    torch.testing.assert_close(f, want_f, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden, want_f, rtol=1e-5, atol=1e-5)  # the inference forward agrees
    torch.testing.assert_close(out.logits, want_l, rtol=1e-5, atol=1e-5)
    # not a coincidence of the inputs: a head from scratch is far from it
    torch.manual_seed(0)
    scratch = build_head(HeadConfig(type="mtp", moe=True), path, dtype="float32").eval()
    with torch.no_grad():
        assert (scratch.forward_train(hidden, nxt, lens) - want_f).abs().max() > 0.1


def test_target_mtp_refusals_name_the_key(target, tiny_checkpoints):
    path, _ = target["sharded"]
    with pytest.raises(ModelConfigError, match=rf"the MTP layer {PREFIX}\* .* has an MoE MLP .*set head.moe=true"):
        build_head(HeadConfig(type="mtp", init="target_mtp"), path)
    llama = tiny_checkpoints["llama"][0]
    n = json.loads((llama / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(ModelConfigError, match=rf"head.init=target_mtp: {llama} holds no model.layers.{n}.\* MTP "
                                               r"layer \(num_nextn_predict_layers=0\)"):
        build_head(HeadConfig(type="mtp", init="target_mtp"), llama)
    plain = target["plain"][0]  # transformers' own save: config says 1, the tensors are not there
    with pytest.raises(ModelConfigError, match=rf"{plain} holds no {PREFIX}\* MTP layer \(num_nextn_predict_layers=1"):
        build_head(HeadConfig(type="mtp", moe=True, init="target_mtp"), plain)
    for over, key in [({"fc_bias": True}, "head.fc_bias=true"), ({"hnorm": False}, "head.hnorm=false"),
                      ({"final_norm": False}, "head.final_norm=false"), ({"features": "aux"}, "head.features=aux")]:
        with pytest.raises(ValueError, match=key):
            HeadConfig.of(type="mtp", init="target_mtp", **over)
    with pytest.raises(ValueError, match="head.init=target_mtp takes mtp heads; eagle1"):
        HeadConfig(type="eagle1", init="target_mtp")


# --- stitching the fine-tuned layer back ----------------------------------------------------------------------------


def _fine_tuned(path, tmp_path):
    """A head from the target's MTP layer with every weight moved (as training would), saved; returns (dir, head)."""
    head = build_head(HeadConfig(type="mtp", moe=True, init="target_mtp"), path, dtype="float32").eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    head_dir = save_head(head, tmp_path / "head", target_fingerprint=weights_fingerprint(path))
    return head_dir, head


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stitched_folder_loads_back_the_fine_tuned_head_with_no_shard_copied(target, tmp_path, layout):
    import transformers

    path, mtp = target[layout]
    head_dir, head = _fine_tuned(path, tmp_path)
    out = tmp_path / "stitched"
    res = stitch_head(head_dir, path, out)
    # the target's files: linked (absolute, to the file itself), never copied; only the new shard is a real file
    old_index = (json.loads((path / INDEX).read_text())["weight_map"] if layout != "single"
                 else dict.fromkeys(_tensors(path / "model.safetensors"), "model.safetensors"))
    real = sorted(p.name for p in out.iterdir() if p.name.endswith(".safetensors") and not p.is_symlink())
    assert real == [NEW_SHARD]
    for name, to in res.links.items():
        link = out / name
        assert link.is_symlink() and os.path.isabs(os.readlink(link)) and to.parent == path.resolve()
        assert os.stat(link).st_ino == os.stat(to).st_ino and os.lstat(link).st_size < os.stat(to).st_size
    want_links = {"sharded": set(old_index.values()), "single": {SINGLE_LINK},
                  "own-shard": set(old_index.values()) - {"model-99999-of-99999.safetensors"}}[layout]
    assert set(res.links) == want_links  # a shard holding only the replaced layer is not linked
    assert res.mixed == {"sharded": [old_index["lm_head.weight"]], "single": [SINGLE_LINK], "own-shard": []}[layout]
    assert (out / "tokenizer_config.json").read_text() == (path / "tokenizer_config.json").read_text()
    assert not (out / "model.safetensors").exists()
    # the index: every other tensor at its own shard, the MTP layer replaced (the same names), not duplicated
    wmap = json.loads((out / INDEX).read_text())["weight_map"]
    assert {k for k, v in wmap.items() if v == NEW_SHARD} == set(mtp) == set(_tensors(out / NEW_SHARD))
    assert set(wmap) == set(old_index)
    assert all(v in res.links for k, v in wmap.items() if not k.startswith(PREFIX))
    stitched_cfg = json.loads((out / "config.json").read_text())
    assert stitched_cfg["num_nextn_predict_layers"] == 1
    assert stitched_cfg["mtp_train"]["config_sha256"] == export_digest(stitched_cfg)
    # our loader: the same target, and the fine-tuned head back through head.init=target_mtp, exactly
    ids, lens = _packed()
    meta = AttentionMetadata.build([len(ids)])
    with torch.no_grad():
        a = load_model(path, dtype="float32", backend="torch")(ids, meta, logits_indices=torch.arange(len(ids)))
        b = load_model(out, dtype="float32", backend="torch")(ids, meta, logits_indices=torch.arange(len(ids)))
    assert torch.equal(a.logits, b.logits)
    back = build_head(HeadConfig(type="mtp", moe=True, init="target_mtp"), out, dtype="float32").eval()
    hidden, nxt = _hidden(target["hf"]), packed_shift(ids, lens, 1)
    with torch.no_grad():
        fa, fb = head.forward_train(hidden, nxt, lens), back.forward_train(hidden, nxt, lens)
        assert torch.equal(fa, fb) and torch.equal(head.compute_logits(fa), back.compute_logits(fb))
        orig = build_head(HeadConfig(type="mtp", moe=True, init="target_mtp"), path, dtype="float32").eval()
        assert not torch.equal(orig.forward_train(hidden, nxt, lens), fb)  # the old layer is gone
    assert verify_stitched(head_dir, out, path) == 0.0
    # transformers loads the stitched folder as it loads the target
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(hf2(ids[None]).logits, target["hf"](ids[None]).logits)


def test_mtp_export_stitch_command_and_its_refusals(target, tmp_path):
    path, _ = target["sharded"]
    head_dir, _ = _fine_tuned(path, tmp_path)
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("export", overrides=[f"head_ckpt={head_dir}", "format=deepseek-mtp", f"stitch={path}",
                                           f"out={tmp_path / 'ds'}"])
        bad = compose("export", overrides=[f"head_ckpt={head_dir}", "format=qwen3-next-mtp", f"stitch={path}",
                                           f"out={tmp_path / 'qn'}"])
    res = export_main(cfg)
    assert res["max_abs_diff"] == 0.0 and res["tensors"] == len(_tensors(tmp_path / "ds" / NEW_SHARD))
    assert export_main(cfg)["max_abs_diff"] == 0.0  # the same head again into its own stitched folder
    with pytest.raises(LayoutError, match="not format=qwen3-next-mtp"):
        export_main(bad)
    with pytest.raises(LayoutError, match="is the target folder itself"):
        stitch_head(head_dir, path, path)


def test_stitch_refuses_a_quantised_target(target, tmp_path):
    path, _ = target["sharded"]
    head = build_head(HeadConfig(type="mtp", moe=True, init="target_mtp"), path, dtype="float32")
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}))
    with pytest.raises(LayoutError, match="declares quantization_config"):
        stitch(head, fp8, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fine_tuned_mtp_layer_stitched_back_drafts_losslessly(target, tmp_path):
    """The whole use: the target's MTP layer as the head's start, a few training steps, stitched back; the stitched
    folder serves as target and head at once, and speculative decoding with them equals plain greedy decoding."""
    from mtp_train.config import LossConfig
    from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
    from mtp_train.head_types.chain import HeadProposer
    from mtp_train.speculative.engine import SpecEngine
    from mtp_train.train.losses import unrolled_loss

    path, _ = target["sharded"]
    model = load_model(path, dtype="float32", backend="torch")
    head = build_head(HeadConfig(type="mtp", moe=True, init="target_mtp"), path, dtype="float32")
    ids, lens = _packed()
    hidden = prefill_hidden(model, SEQS).hidden
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(6):
        loss, _ = unrolled_loss(head, hidden, ids, torch.ones_like(ids), lens, LossConfig(steps=2, w_tok=1.0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
    head.eval()
    out = stitch_head(save_head(head, tmp_path / "head", target_fingerprint=weights_fingerprint(path)), path,
                      tmp_path / "stitched").out
    served = load_model(out, dtype="float32", backend="torch")
    back = build_head(HeadConfig(type="mtp", moe=True, init="target_mtp"), out, dtype="float32").eval()
    nxt = packed_shift(ids, lens, 1)
    with torch.no_grad():
        assert torch.equal(back.forward_train(hidden, nxt, lens), head.forward_train(hidden, nxt, lens))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ref = [o.output_ids for o in LLMEngine(model, page_size=3, num_pages=128).generate(SEQS, params)]
    spec = SpecEngine(served, HeadProposer(back), 3, page_size=3, num_pages=128)
    assert [o.output_ids for o in spec.generate(SEQS, params)] == ref
