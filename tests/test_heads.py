"""Draft heads: structure and norms, frozen target parts, train/inference agreement, unrolled alignment, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

import mtp_train.heads.frozen as frozen_mod
from mtp_train.config import HeadConfig
from mtp_train.config.head import HEAD_TYPES, HeadType
from mtp_train.engine import prefill_hidden
from mtp_train.head_types.mtp.head import MTPHead
from mtp_train.heads import (
    DraftHead,
    FrozenTargetParts,
    build_head,
    load_head,
    packed_shift,
    packed_valid,
    read_head_config,
    save_head,
)
from mtp_train.heads.registry import head_class
from mtp_train.layers import AttentionMetadata
from mtp_train.layers.attention import KVLayout
from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.fingerprint import weights_fingerprint
from tests._chain import assert_unroll_is_the_inference_chain, new_cache, seq_starts

TOL = dict(rtol=1e-5, atol=1e-5)
LENS = [5, 9, 7]  # a packed batch of three sequences


pytestmark = pytest.mark.usefixtures("one_thread")


def _head(tiny, name: str, type_: str = "mtp", **kw) -> DraftHead:
    return build_head(HeadConfig.of(type=type_, **kw), tiny[name][0], dtype="float32")


def _batch(tiny, name: str, lens=LENS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Real target hidden states (T, H) of random sequences and their tokens (T,)."""
    target = load_model(tiny[name][0], dtype="float32", backend="torch")
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, target.args.vocab_size, (n,), generator=g).tolist() for n in lens]
    hidden = prefill_hidden(target, seqs).hidden
    return hidden, torch.tensor([t for s in seqs for t in s])


# --- frozen target parts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama-tied"])
def test_frozen_parts_read_only_embedding_and_lm_head(tiny_checkpoints, name, monkeypatch):
    read: list[str] = []
    iter_tensors = frozen_mod.iter_tensors

    def spy(files):
        for n, t in iter_tensors(files):
            read.append(n)
            yield n, t

    monkeypatch.setattr(frozen_mod, "iter_tensors", spy)
    path = tiny_checkpoints[name][0]
    frozen = FrozenTargetParts.from_pretrained(path, dtype="float32")
    tied = name == "llama-tied"
    assert read == (["model.embed_tokens.weight"] if tied else ["model.embed_tokens.weight", "lm_head.weight"])
    target = load_model(path, dtype="float32")
    torch.testing.assert_close(frozen.embed, target.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(frozen.lm_head, target.lm_head.weight, rtol=0, atol=0)
    assert frozen.tied is tied and (frozen.lm_head is frozen.embed) is tied
    assert not frozen.embed.requires_grad and not frozen.lm_head.requires_grad


# --- structure --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_", ["mtp", "eagle1"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_shapes_follow_the_target_config_gqa_included(tiny_checkpoints, name, type_):
    head = _head(tiny_checkpoints, name, type_)
    a = head.args
    assert a.num_kv_heads < a.num_heads and a.num_layers == 1
    h, hq, hkv, d = a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim
    assert (name == "qwen3") == (d != h // hq)  # qwen3's tiny config has head_dim 32 ≠ 64 / 4
    layer = head.layers[0]
    assert head.fc.weight.shape == (h, 2 * h) and head.fc.bias is None
    assert layer.self_attn.qkv_proj.weight.shape == ((hq + 2 * hkv) * d, h)
    assert layer.self_attn.o_proj.weight.shape == (h, hq * d)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * a.intermediate_size, h)
    assert (layer.self_attn.q_norm is not None) == (name == "qwen3")
    assert head.kv_shape == (1, KVLayout(hkv, d))
    hidden, tokens = _batch(tiny_checkpoints, name)
    out = head.forward_train(hidden, packed_shift(tokens, LENS, 1), LENS)
    assert out.shape == hidden.shape and out.dtype == torch.float32
    assert head.compute_logits(out[:4]).shape == (4, a.vocab_size)
    cu = torch.tensor([0, 5, 14, 21])
    torch.testing.assert_close(head.forward_train(hidden, packed_shift(tokens, LENS, 1), cu_seqlens=cu), out)
    with pytest.raises(ValueError, match="sum to 20"):
        head.forward_train(hidden, tokens, [5, 9, 6])


def test_mtp_and_eagle1_differ_exactly_by_their_norms(tiny_checkpoints):
    mtp, eagle = _head(tiny_checkpoints, "llama", "mtp"), _head(tiny_checkpoints, "llama", "eagle1")
    assert all(m is not None for m in (mtp.enorm, mtp.hnorm, mtp.layers[0].input_layernorm, mtp.norm))
    assert all(m is None for m in (eagle.enorm, eagle.hnorm, eagle.layers[0].input_layernorm, eagle.norm))
    assert eagle.layers[0].post_attention_layernorm is not None  # EAGLE keeps it
    only_mtp = set(mtp.state_dict()) - set(eagle.state_dict())
    assert only_mtp == {"enorm.weight", "hnorm.weight", "layers.0.input_layernorm.weight", "norm.weight"}
    assert set(eagle.state_dict()) <= set(mtp.state_dict())

    # Behaviour, not just presence: hnorm makes the head blind to the scale of its input hidden state, and the
    # final norm (weight 1 at scratch init) gives outputs of unit RMS.
    hidden, tokens = _batch(tiny_checkpoints, "llama")
    nxt = packed_shift(tokens, LENS, 1)
    with torch.no_grad():
        out_m, out_e = mtp.forward_train(hidden, nxt, LENS), eagle.forward_train(hidden, nxt, LENS)
        torch.testing.assert_close(mtp.forward_train(7 * hidden, nxt, LENS), out_m, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(eagle.forward_train(7 * hidden, nxt, LENS), out_e, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out_m.pow(2).mean(-1).sqrt(), torch.ones(len(out_m)), rtol=1e-3, atol=1e-3)
    assert (out_e.pow(2).mean(-1).sqrt() - 1).abs().max() > 0.1


def test_norm_flags_switch_one_at_a_time(tiny_checkpoints):
    cfg = HeadConfig(type="eagle1", final_norm=True).resolved()
    assert (cfg.enorm, cfg.hnorm, cfg.input_norm, cfg.final_norm) == (False, False, False, True)
    head = _head(tiny_checkpoints, "llama", "eagle1", final_norm=True, fc_bias=True)
    assert head.norm is not None and head.enorm is None and head.fc.bias is not None
    head = _head(tiny_checkpoints, "llama", "mtp", hnorm=False)
    assert head.hnorm is None and head.enorm is not None and head.norm is not None
    with pytest.raises(ValueError, match="unknown head type"):
        HeadConfig(type="medusa")
    with pytest.raises(ValueError, match="unknown head init"):
        HeadConfig(init="random")


# --- frozen parts stay outside the trainable module -------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama-tied"])
def test_frozen_tensors_are_not_trained_saved_or_cast(tiny_checkpoints, name):
    head = _head(tiny_checkpoints, name, "mtp")
    frozen = head.frozen
    frozen_ptrs = {frozen.embed.data_ptr(), frozen.lm_head.data_ptr()}
    names = [n for n, _ in head.named_parameters()]
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert all(p.requires_grad for p in head.parameters())
    assert set(head.state_dict()) == set(names)  # no buffers either
    assert not any(t.data_ptr() in frozen_ptrs for t in head.state_dict().values())
    assert sum(p.numel() for p in head.parameters()) == head.num_params()

    embed0, lm0 = frozen.embed.clone(), frozen.lm_head.clone()
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    hidden, tokens = _batch(tiny_checkpoints, name)
    out = head.forward_train(hidden, packed_shift(tokens, LENS, 1), LENS)
    head.compute_logits(out).logsumexp(-1).mean().backward()
    opt.step()
    assert frozen.embed.grad is None and frozen.lm_head.grad is None
    torch.testing.assert_close(frozen.embed, embed0, rtol=0, atol=0)
    torch.testing.assert_close(frozen.lm_head, lm0, rtol=0, atol=0)
    assert all(not torch.equal(before[n], p) for n, p in head.named_parameters())

    head.to(torch.float64)  # what a training engine does to its module: the frozen parts keep their dtype
    assert head.frozen.embed.dtype == torch.float32 and head.fc.weight.dtype == torch.float64


# --- init from the target's last layer --------------------------------------------------------------------------


@pytest.mark.parametrize("type_", ["mtp", "eagle1"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_init_last_layer_copies_the_targets_last_layer(tiny_checkpoints, name, type_):
    target = load_model(tiny_checkpoints[name][0], dtype="float32")
    last = target.model.layers[-1].state_dict()
    head = _head(tiny_checkpoints, name, type_, init="last_layer")
    own = head.layers[0].state_dict()
    if type_ == "eagle1":
        assert "input_layernorm.weight" not in own
        last.pop("input_layernorm.weight")
    assert set(own) == set(last)
    for k in own:
        torch.testing.assert_close(own[k], last[k], rtol=0, atol=0, msg=k)
    scratch = _head(tiny_checkpoints, name, type_)
    assert not torch.equal(scratch.layers[0].self_attn.qkv_proj.weight, own["self_attn.qkv_proj.weight"])


# --- one module, two modes --------------------------------------------------------------------------------------


def _prefill_through_pages(head, hidden, tokens, lens, split: int, page_size: int = 4) -> torch.Tensor:
    """First `split` rows of each sequence as a cached prefill, the rest as one verify step on top of them."""
    kv = new_cache(head, page_size)
    pages = [[] for _ in lens]
    starts = seq_starts(lens)
    first = [min(split, n) for n in lens]
    for b, n in enumerate(first):
        kv.ensure(pages[b], n)
    rows = torch.tensor([starts[b] + i for b, n in enumerate(first) for i in range(n)])
    out = torch.empty_like(hidden)
    meta = AttentionMetadata.build(first, first, pages, page_size)
    out[rows] = head(hidden[rows], tokens[rows], meta, kv.layers[0], from_target=True).hidden
    rest = [n - f for n, f in zip(lens, first)]
    for b, n in enumerate(lens):
        kv.ensure(pages[b], n)
    rows = torch.tensor([starts[b] + first[b] + i for b, n in enumerate(rest) for i in range(n)])
    meta = AttentionMetadata.build(rest, lens, pages, page_size)
    out[rows] = head(hidden[rows], tokens[rows], meta, kv.layers[0], from_target=True).hidden
    return out


def _decode_through_pages(head, hidden, tokens, lens, page_size: int = 3) -> torch.Tensor:
    """Every row as its own decode step; pages grow one step at a time, interleaved between sequences."""
    kv = new_cache(head, page_size)
    pages = [[] for _ in lens]
    starts = seq_starts(lens)
    out = torch.empty_like(hidden)
    for t in range(max(lens)):
        live = [b for b, n in enumerate(lens) if n > t]
        for b in live:
            kv.ensure(pages[b], t + 1)
        rows = torch.tensor([starts[b] + t for b in live])
        meta = AttentionMetadata.build([1] * len(live), [t + 1] * len(live), [pages[b] for b in live], page_size)
        out[rows] = head(hidden[rows], tokens[rows], meta, kv.layers[0], from_target=True).hidden
    return out


CASES = [("llama", LENS), ("qwen3", LENS), ("mistral", [20, 18])]  # mistral: longer than its window of 16


@pytest.mark.parametrize("type_", ["mtp", "eagle1"])
@pytest.mark.parametrize(("name", "lens"), CASES, ids=[c[0] for c in CASES])
def test_training_forward_equals_inference_prefill_verify_and_paged_decode(tiny_checkpoints, name, lens, type_):
    head = _head(tiny_checkpoints, name, type_, init="last_layer")
    hidden, tokens = _batch(tiny_checkpoints, name, lens)
    nxt = packed_shift(tokens, lens, 1)
    train = head.forward_train(hidden, nxt, lens)
    assert train.requires_grad
    with torch.no_grad():
        last = torch.tensor(seq_starts(lens)) + torch.tensor(lens) - 1
        prefill = head(hidden, nxt, AttentionMetadata.build(lens), from_target=True, logits_indices=last)
        torch.testing.assert_close(prefill.hidden, train, **TOL)
        torch.testing.assert_close(prefill.logits, head.compute_logits(train[last]), **TOL)
        torch.testing.assert_close(_prefill_through_pages(head, hidden, nxt, lens, split=3), train, **TOL)
        torch.testing.assert_close(_decode_through_pages(head, hidden, nxt, lens), train, **TOL)


# --- unrolled steps ---------------------------------------------------------------------------------------------


def test_packed_shift_by_hand():
    lens = [4, 3]
    ids = torch.tensor([10, 11, 12, 13, 20, 21, 22])
    assert packed_shift(ids, lens, 1).tolist() == [11, 12, 13, 0, 21, 22, 0]
    assert packed_shift(ids, lens, 2).tolist() == [12, 13, 0, 0, 22, 0, 0]
    assert packed_valid(lens, 2).tolist() == [True, True, False, False, True, False, False]
    x = torch.arange(14.0).view(7, 2)
    assert packed_shift(x, lens, 1, fill=-1)[3].tolist() == [-1, -1] and packed_shift(x, lens, 1)[0].tolist() == [2, 3]


@pytest.mark.parametrize("attention", ["chain", "causal"])
def test_unroll_feeds_own_output_and_shifts_tokens_one_more_per_step(tiny_checkpoints, attention, monkeypatch):
    head = _head(tiny_checkpoints, "llama", "mtp")
    lens = [4, 3]
    tokens = torch.tensor([10, 11, 12, 13, 20, 21, 22])
    hidden = torch.randn(7, head.args.hidden_size, generator=torch.Generator().manual_seed(0))
    calls = []
    features = type(head).features

    def spy(self, x, token_ids, meta, kv_cache, attn, *, from_target):
        calls.append((x, token_ids.tolist(), meta.positions.tolist(), from_target))
        return features(self, x, token_ids, meta, kv_cache, attn, from_target=from_target)

    monkeypatch.setattr(type(head), "features", spy)
    outs = head.unroll(hidden, tokens, lens, steps=3, attention=attention)
    assert [c[1] for c in calls] == [[11, 12, 13, 0, 21, 22, 0], [12, 13, 0, 0, 22, 0, 0], [13, 0, 0, 0, 0, 0, 0]]
    assert [c[2] for c in calls] == [[0, 1, 2, 3, 0, 1, 2], [1, 2, 3, 4, 1, 2, 3], [2, 3, 4, 5, 2, 3, 4]]
    assert calls[0][0] is hidden and calls[1][0] is outs[0] and calls[2][0] is outs[1]
    assert [c[3] for c in calls] == [True, False, False]  # the caller says which step reads the target
    monkeypatch.undo()
    # Step 0 is the plain training forward; in causal mode every step is one (RoPE is relative).
    torch.testing.assert_close(outs[0], head.forward_train(hidden, packed_shift(tokens, lens, 1), lens), **TOL)
    if attention == "causal":
        torch.testing.assert_close(outs[1], head.forward_train(outs[0], packed_shift(tokens, lens, 2), lens), **TOL)

    # Which inputs a row depends on: change t_2 (the third token of the first sequence) and see who moves.
    changed = tokens.clone()
    changed[2] = 99
    with torch.no_grad():  # both runs on the same (inference) matmul path, so only real dependence shows
        base, other = head.unroll(hidden, tokens, lens, 3, attention), head.unroll(hidden, changed, lens, 3, attention)
        moved = [(a - b).abs().amax(-1) > 1e-6 for a, b in zip(base, other)]
    # Step 0: row 1 consumes t_2 and rows 2, 3 attend to it. Step 1: row 0 consumes t_2 itself and the later rows
    # read step-0 outputs that moved. The other sequence never moves.
    assert moved[0].tolist() == [False, True, True, True, False, False, False]
    assert moved[1].tolist() == [True, True, True, True, False, False, False]


@pytest.mark.parametrize(("name", "lens"), [("qwen3", [6, 5]), ("mistral", [19])], ids=["qwen3", "mistral"])
def test_chain_unroll_equals_the_inference_chain_through_a_paged_cache(tiny_checkpoints, name, lens):
    """Row i of step j = draft step j of a chain started at position i over the engine's paged cache.

    Inference: the head's cache is filled from the target's hidden states for positions 0..i (tokens t_1..t_{i+1}),
    then each draft step feeds the previous step's output with the next token at the next position.
    """
    head = _head(tiny_checkpoints, name, "mtp", init="last_layer")
    steps, page_size = 3, 2
    hidden, tokens = _batch(tiny_checkpoints, name, lens)
    with torch.no_grad():
        outs = head.unroll(hidden, tokens, lens, steps, attention="chain")
        causal = head.unroll(hidden, tokens, lens, steps, attention="causal")
        assert_unroll_is_the_inference_chain(head, hidden, tokens, lens, outs, page_size, TOL)
    # The causal mode is a different (cheaper-context) approximation: its later steps differ.
    assert not torch.allclose(causal[1], outs[1], atol=1e-4)


# --- checkpoints ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_", ["mtp", "eagle1"])
def test_save_load_round_trip(tiny_checkpoints, tmp_path, type_):
    path = tiny_checkpoints["qwen3"][0]
    head = _head(tiny_checkpoints, "qwen3", type_, init="last_layer", fc_bias=True)
    with torch.no_grad():
        head.fc.bias.normal_()
    fp = weights_fingerprint(path)
    save_head(head, tmp_path / "h", {"step": 7}, target_fingerprint=fp)
    cfg = read_head_config(tmp_path / "h")
    assert cfg["head"] == head.cfg.to_dict() and cfg["head"]["type"] == type_
    assert cfg["dims"]["head_dim"] == 32 and cfg["dims"]["vocab_size"] == 256
    assert cfg["target_fingerprint"] == fp and cfg["num_params"] == head.num_params() and cfg["extra"] == {"step": 7}
    loaded = load_head(tmp_path / "h", path)
    assert type(loaded) is type(head) and loaded.cfg == head.cfg and not loaded.training
    for k, v in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)
    assert all(p.requires_grad for p in loaded.parameters())  # ready to train further
    hidden, tokens = _batch(tiny_checkpoints, "qwen3")
    nxt = packed_shift(tokens, LENS, 1)
    with torch.no_grad():
        a = head(hidden, nxt, AttentionMetadata.build(LENS), from_target=True, logits_indices=torch.arange(4))
        b = loaded(hidden, nxt, AttentionMetadata.build(LENS), from_target=True, logits_indices=torch.arange(4))
    torch.testing.assert_close(b.hidden, a.hidden, rtol=0, atol=0)
    torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=0)
    assert load_head(tmp_path / "h", path, dtype="bfloat16").fc.weight.dtype == torch.bfloat16


def test_load_refuses_a_head_of_other_dims(tiny_checkpoints, tmp_path):
    save_head(_head(tiny_checkpoints, "llama", "mtp"), tmp_path / "h")  # head_dim 16
    with pytest.raises(ModelConfigError) as e:
        load_head(tmp_path / "h", tiny_checkpoints["qwen3"][0])  # head_dim 32
    msg = str(e.value)
    assert "dims.head_dim: head checkpoint 16, target 32" in msg
    assert "layers.0.self_attn.qkv_proj.weight: head checkpoint (128, 64), target implies (256, 64)" in msg
    assert "layers.0.self_attn.q_norm.weight: missing" in msg


def test_load_refuses_other_target_weights_or_a_foreign_folder(tiny_checkpoints, tmp_path):
    llama, tied = tiny_checkpoints["llama"][0], tiny_checkpoints["llama-tied"][0]
    save_head(_head(tiny_checkpoints, "llama", "mtp"), tmp_path / "h", target_fingerprint=weights_fingerprint(llama))
    with pytest.raises(ModelConfigError, match="was trained for target weights"):
        load_head(tmp_path / "h", tied)  # same dims, other weights
    assert load_head(tmp_path / "h", tied, verify_fingerprint=False).frozen.tied
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**cfg, "format": "other"}))
    with pytest.raises(ModelConfigError, match="is not 'mtp_train.head'"):
        load_head(tmp_path / "h", llama)
    with pytest.raises(ModelConfigError, match="not a head checkpoint"):
        load_head(tmp_path / "missing", llama)


def test_flipped_or_truncated_weights_and_a_damaged_config_are_refused_by_file(tiny_checkpoints, tmp_path, caplog):
    """The head's config.json records model.safetensors' sha256; a changed byte, a cut file or broken JSON is an
    error naming the file, before any tensor is read."""
    llama = tiny_checkpoints["llama"][0]
    save_head(_head(tiny_checkpoints, "llama", "mtp"), tmp_path / "h")
    weights, config = tmp_path / "h" / "model.safetensors", tmp_path / "h" / "config.json"
    assert read_head_config(tmp_path / "h")["files"]["model.safetensors"]["bytes"] == weights.stat().st_size
    good = weights.read_bytes()
    flipped = bytearray(good)
    for i in range(len(good) - 4096, len(good)):  # 4 KB of weights, the header intact: safetensors reads it fine
        flipped[i] ^= 0xFF
    weights.write_bytes(bytes(flipped))
    with pytest.raises(ModelConfigError, match=rf"{weights}.*does not match the sha256 recorded in {config}"):
        load_head(tmp_path / "h", llama)
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelConfigError, match=rf"{weights} has \d+ bytes, {config} records"):
        load_head(tmp_path / "h", llama)
    weights.write_bytes(good)
    text = config.read_text()
    config.write_text(text[: len(text) // 2])
    with pytest.raises(ModelConfigError, match=rf"{config}: invalid JSON at line \d+ column \d+"):
        load_head(tmp_path / "h", llama)
    # A head written before checksums were recorded still loads (with a warning), and a truncated file of one
    # is named by the safetensors reader.
    cfg = json.loads(text)
    del cfg["files"], cfg["config_sha256"]
    config.write_text(json.dumps(cfg))
    assert load_head(tmp_path / "h", llama) is not None and "records no checksums" in caplog.text
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelConfigError, match=rf"{weights}: not a readable safetensors file"):
        load_head(tmp_path / "h", llama)


def test_every_head_type_is_one_registered_plug_in():
    """Each head type is one registered object: its spec's name is its own, its class says the same name, a second
    registration under a known name is refused, and an unknown name is answered with the known ones."""
    assert set(HEAD_TYPES) >= {"mtp", "eagle1", "eagle3"}
    for name, t in HEAD_TYPES.items():
        assert t.name == name and head_class(name).type_name == name and head_class(name) is t.module
    with pytest.raises(ValueError, match="head type 'mtp' is registered twice"):
        HEAD_TYPES.add(HeadType(HEAD_TYPES["mtp"].spec, MTPHead, HEAD_TYPES["mtp"].drafter,
                                HEAD_TYPES["mtp"].inference_path))
    with pytest.raises(ValueError, match="unknown head type 'medusa'; choose one of .*mtp"):
        head_class("medusa")
