"""The eagle3 head: its forward against an independent reference of EAGLE-3's equations, its state-dict names,
training = inference (prefill, verify, paged decode, the chained training-time test), its own lm_head rows, the
aux-feature option of the mtp head, and the refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mtp_train.config import HeadConfig
from mtp_train.config.head import default_aux_layers
from mtp_train.engine import prefill_hidden
from mtp_train.export import LayoutError, check_fits
from mtp_train.heads import DraftHead, build_head, load_head, packed_shift, save_head
from mtp_train.layers import AttentionMetadata
from mtp_train.models import load_model
from mtp_train.models.fingerprint import weights_fingerprint
from tests._chain import assert_unroll_is_the_inference_chain, new_cache, seq_starts

TOL = dict(rtol=1e-5, atol=1e-5)
LENS = [5, 9, 7]

pytestmark = pytest.mark.usefixtures("one_thread")


def _eagle3(tiny, name: str = "llama", **kw) -> DraftHead:
    kw.setdefault("draft_vocab_size", 64)
    return build_head(HeadConfig.of(type="eagle3", **kw), tiny[name][0], dtype="float32")


def _aux_batch(tiny, name: str, layers, lens=LENS, seed: int = 0):
    """(aux (T, k·H), final hidden (T, H), tokens (T,)) of random sequences through the tiny target."""
    target = load_model(tiny[name][0], dtype="float32", backend="torch")
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, target.args.vocab_size, (n,), generator=g).tolist() for n in lens]
    out = prefill_hidden(target, seqs, hidden_layers=layers)
    aux = torch.cat([out.layers[j] for j in layers], -1)
    return aux, out.hidden, torch.tensor([t for s in seqs for t in s])


# --- the reference: EAGLE-3's equations, written out by hand ------------------------------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """x: (n, heads, D) rotated by the rotate-half convention at positions pos (n,)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]  # (n, D/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def reference_eagle3(sd, embed, aux, tokens, cfg, theta, norm_before_residual=False):
    """One sequence, step 0, causal: EAGLE-3 as published (fc over 3 layers; [E ; g] into attention; residual g, or
    hidden_norm(g) with `norm_before_residual`, speculators' `Eagle3FirstLayerMixin.forward`)."""
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // nh
    p = "layers.0."
    g = aux @ sd["fc.weight"].T
    e = embed[tokens]
    gn = _rms(g, sd[p + "hidden_norm.weight"], eps)
    u = torch.cat([_rms(e, sd[p + "input_layernorm.weight"], eps), gn], -1)
    q, k, v = (u @ sd[p + "self_attn.qkv_proj.weight"].T).split([nh * d, nkv * d, nkv * d], -1)
    n = u.shape[0]
    pos = torch.arange(n)
    q = _rope(q.view(n, nh, d), pos, theta)
    k = _rope(k.view(n, nkv, d), pos, theta).repeat_interleave(nh // nkv, 1)
    v = v.view(n, nkv, d).repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nh * d)
    r = (gn if norm_before_residual else g) + att @ sd[p + "self_attn.o_proj.weight"].T
    mid = _rms(r, sd[p + "post_attention_layernorm.weight"], eps)
    gate, up = (mid @ sd[p + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
    x = r + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    logits = _rms(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T
    return x, logits


def test_forward_equals_the_published_equations_and_names_follow_the_contract(tiny_checkpoints):
    head = _eagle3(tiny_checkpoints)
    with torch.no_grad():
        for p in head.parameters():  # away from identity norms and the copied lm_head rows
            p.add_(torch.randn_like(p) * 0.05)
    cfg = tiny_checkpoints["llama"][1].config
    theta = json.loads((tiny_checkpoints["llama"][0] / "config.json").read_text()).get("rope_theta", 10000.0)
    h, v_d = cfg.hidden_size, 64
    shapes = {k: tuple(t.shape) for k, t in head.state_dict().items()}
    assert shapes == {
        "draft_vocab": (v_d,), "fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (v_d, h),
        "layers.0.input_layernorm.weight": (h,), "layers.0.hidden_norm.weight": (h,),
        "layers.0.self_attn.qkv_proj.weight": ((4 + 2 * 2) * 16, 2 * h), "layers.0.self_attn.o_proj.weight": (h, h),
        "layers.0.post_attention_layernorm.weight": (h,), "layers.0.mlp.gate_up_proj.weight": (2 * 128, h),
        "layers.0.mlp.down_proj.weight": (h, 128),
    }
    assert head.aux_layers == default_aux_layers(3) == [2, 1, 0]
    aux, _, tokens = _aux_batch(tiny_checkpoints, "llama", head.aux_layers, [8])
    nxt = packed_shift(tokens, [8], 1)
    sd = {k: t.detach() for k, t in head.state_dict().items()}
    want_x, want_logits = reference_eagle3(sd, head.frozen.embed, aux, nxt, cfg, theta)
    with torch.no_grad():
        out = head(aux, nxt, AttentionMetadata.build([8]), from_target=True, logits_indices=torch.arange(8))
    torch.testing.assert_close(out.hidden, want_x, **TOL)
    torch.testing.assert_close(out.logits, want_logits, **TOL)


def test_own_lm_head_starts_as_the_target_rows_and_draft_vocab_is_mandatory(tiny_checkpoints):
    head = _eagle3(tiny_checkpoints)
    ids = torch.arange(0, 256, 4)  # 64 ids
    head.set_draft_vocab(ids)
    torch.testing.assert_close(head.lm_head.weight, head.frozen.lm_head[ids])
    assert head.lm_head.weight.requires_grad and head.draft_lm_head() is head.lm_head.weight
    capped = _eagle3(tiny_checkpoints, draft_vocab_size=32000)  # capped at the target's 256
    assert capped.vocab_size == 256 and capped.draft_vocab is not None
    with pytest.raises(ValueError, match="draft_vocab_size"):
        HeadConfig(type="eagle3")
    with pytest.raises(ValueError, match="fixed norms"):
        HeadConfig(type="eagle3", draft_vocab_size=8, hnorm=False)
    with pytest.raises(ValueError, match="features=aux"):
        HeadConfig(type="mtp", aux_layers=[1, 2])
    with pytest.raises(ValueError, match="head.aux_layers"):
        _eagle3(tiny_checkpoints, aux_layers=[1, 2, 9])


EAGLE31 = dict(aux_norm=True, norm_output=True)
# speculators' EAGLE-3 recipe (conf/recipe/speculators-eagle3.yaml): norm_before_fc, norm_before_residual,
# norm_output, a frozen draft lm_head
SPECULATORS = dict(fc_input_norm=True, norm_before_residual=True, norm_output=True, train_lm_head=False)
CASES = [("llama", LENS, {}), ("qwen3", LENS, {}), ("mistral", [20, 18], {}), ("llama", LENS, EAGLE31),
         ("llama", LENS, SPECULATORS), ("qwen3", [6, 5], dict(norm_before_residual=True))]
CASE_IDS = ["llama", "qwen3", "mistral", "llama-eagle3.1", "llama-speculators", "qwen3-norm-before-residual"]


def _perturb(head: DraftHead, seed: int = 1) -> None:
    """Move every weight off its initial value (norms off identity, lm_head off the copied rows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_eagle31_norms_follow_the_published_equations(tiny_checkpoints):
    """head.aux_norm: fc reads [n_1(a^1) ; n_2(a^2) ; n_3(a^3)] (one RMSNorm per aux layer, speculators' fc_norm);
    head.norm_output: the output feature is norm(x), and the logits read it as is. Each flag changes the output."""
    head = _eagle3(tiny_checkpoints, **EAGLE31)
    _perturb(head)
    cfg = tiny_checkpoints["llama"][1].config
    theta = json.loads((tiny_checkpoints["llama"][0] / "config.json").read_text()).get("rope_theta", 10000.0)
    h = cfg.hidden_size
    sd = {k: t.detach() for k, t in head.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in sd.items() if k.startswith("aux_norm.")} == {
        f"aux_norm.{i}.weight": (h,) for i in range(3)}
    aux, _, tokens = _aux_batch(tiny_checkpoints, "llama", head.aux_layers, [8])
    nxt = packed_shift(tokens, [8], 1)
    normed = torch.cat([_rms(c, sd[f"aux_norm.{i}.weight"], cfg.rms_norm_eps) for i, c in enumerate(aux.split(h, -1))],
                       -1)
    want_x, want_logits = reference_eagle3(sd, head.frozen.embed, normed, nxt, cfg, theta)
    meta, rows = AttentionMetadata.build([8]), torch.arange(8)
    with torch.no_grad():
        out = head(aux, nxt, meta, from_target=True, logits_indices=rows)
        torch.testing.assert_close(out.hidden, _rms(want_x, sd["norm.weight"], cfg.rms_norm_eps), **TOL)
        torch.testing.assert_close(out.logits, want_logits, **TOL)
        for flag in EAGLE31:  # the same weights with one flag off give another output
            other = _eagle3(tiny_checkpoints, **{**EAGLE31, flag: False})
            other.load_state_dict({k: v for k, v in sd.items() if flag != "aux_norm" or not k.startswith("aux_norm.")})
            assert not torch.allclose(other(aux, nxt, meta, from_target=True).hidden, out.hidden, **TOL), flag


def test_speculators_norms_follow_the_published_equations_forward_and_backward(tiny_checkpoints):
    """head.fc_input_norm: fc reads n(a), ONE RMSNorm over the whole k·H row (speculators' norm_before_fc,
    `input_norm`); head.norm_before_residual: the layer's residual is hidden_norm(g). The head's inference forward
    and its training unroll equal the hand-written equations, and so does every weight's gradient (the reference
    reads the head's own parameters); each flag alone changes the output."""
    flags = dict(fc_input_norm=True, norm_before_residual=True)
    head = _eagle3(tiny_checkpoints, **flags)
    _perturb(head)
    cfg = tiny_checkpoints["llama"][1].config
    theta = json.loads((tiny_checkpoints["llama"][0] / "config.json").read_text()).get("rope_theta", 10000.0)
    eps, h = cfg.rms_norm_eps, cfg.hidden_size
    params = dict(head.named_parameters())
    assert tuple(params["fc_input_norm.weight"].shape) == (3 * h,) and not any("aux_norm" in k for k in params)
    aux, _, tokens = _aux_batch(tiny_checkpoints, "llama", head.aux_layers, [8])
    nxt = packed_shift(tokens, [8], 1)

    def reference():
        return reference_eagle3(params, head.frozen.embed, _rms(aux, params["fc_input_norm.weight"], eps), nxt, cfg,
                                theta, norm_before_residual=True)

    meta, rows = AttentionMetadata.build([8]), torch.arange(8)
    with torch.no_grad():
        want_x, want_logits = reference()
        out = head(aux, nxt, meta, from_target=True, logits_indices=rows)
        torch.testing.assert_close(out.hidden, want_x, **TOL)
        torch.testing.assert_close(out.logits, want_logits, **TOL)
        sd = head.state_dict()
        for flag in flags:  # the same weights with one flag off give another output
            other = _eagle3(tiny_checkpoints, **{**flags, flag: False})
            other.load_state_dict({k: v for k, v in sd.items() if flag != "fc_input_norm" or "fc_input" not in k})
            assert not torch.allclose(other(aux, nxt, meta, from_target=True).hidden, out.hidden, **TOL), flag
    g = torch.Generator().manual_seed(3)
    wx, wl = torch.randn(want_x.shape, generator=g), torch.randn(want_logits.shape, generator=g)
    x = head.unroll(aux, tokens, [8], 1)[0]  # the training path
    torch.testing.assert_close(x.detach(), want_x, **TOL)
    ((x * wx).sum() + (head.compute_logits(x) * wl).sum()).backward()
    grads = {k: p.grad.clone() for k, p in params.items()}
    head.zero_grad(set_to_none=True)
    want_x, want_logits = reference()
    ((want_x * wx).sum() + (want_logits * wl).sum()).backward()
    for k, p in params.items():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-5, msg=k)


def test_a_frozen_lm_head_gets_no_gradient_and_stays_the_targets_rows(tiny_checkpoints):
    """head.train_lm_head=false (speculators' frozen draft lm_head): the rows are the target's rows of the draft
    vocabulary, require no gradient, are in neither optimiser's groups (the trainer's split, Muon's vocabulary group
    included) and are bit-for-bit the target's after optimiser steps with weight decay, while every other weight
    moves; the default head's rows move under the same steps."""
    from mtp_train.config import LossConfig, OptimConfig
    from mtp_train.train.losses import HeadLoss, step_token_counts
    from mtp_train.train.optimizers import build_muon, split_for_muon

    aux, hidden, tokens = _aux_batch(tiny_checkpoints, "llama", default_aux_layers(3), [9, 7])
    lens, mask = [9, 7], torch.ones(16, dtype=torch.bool)
    loss_cfg = LossConfig(kind="soft_ce", steps=3, w_feat=0.0, w_tok=1.0, mask_out_of_draft=False)
    moved = {}
    for train_lm_head in (False, True):
        head = _eagle3(tiny_checkpoints, train_lm_head=train_lm_head)
        head.set_draft_vocab(torch.arange(0, 256, 4))
        rows = head.frozen.lm_head[head.draft_vocab].clone()
        assert head.lm_head.weight.requires_grad is train_lm_head
        torch.testing.assert_close(head.lm_head.weight, rows, rtol=0, atol=0)
        module = HeadLoss(head, loss_cfg)
        split = split_for_muon(module.named_parameters())
        in_groups = {n for part in split.values() for n, _ in part}
        assert ("head.lm_head.weight" in in_groups) is train_lm_head and "head.fc.weight" in in_groups
        opt = build_muon(module, OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0))
        start = {k: v.detach().clone() for k, v in head.state_dict().items()}
        counts = step_token_counts(mask, lens, loss_cfg.steps)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss, _ = module(hidden, tokens, mask, lens, counts, aux_hidden=aux)
            loss.backward()
            assert (head.lm_head.weight.grad is None) is not train_lm_head
            opt.step()
        moved[train_lm_head] = {k for k, v in head.state_dict().items() if not torch.equal(v, start[k])}
        if not train_lm_head:
            torch.testing.assert_close(head.lm_head.weight, rows, rtol=0, atol=0)
    assert "lm_head.weight" not in moved[False] and "lm_head.weight" in moved[True]
    assert moved[False] == moved[True] - {"lm_head.weight"}  # every other weight trains as before


@pytest.mark.parametrize(("name", "lens", "flags"), CASES, ids=CASE_IDS)
def test_training_forward_equals_inference_prefill_verify_and_decode(tiny_checkpoints, name, lens, flags):
    head = _eagle3(tiny_checkpoints, name, **flags)
    if flags:
        _perturb(head)
    aux, _, tokens = _aux_batch(tiny_checkpoints, name, head.aux_layers, lens)
    nxt = packed_shift(tokens, lens, 1)
    train = head.forward_train(aux, nxt, lens)
    starts = seq_starts(lens)
    with torch.no_grad():
        last = torch.tensor(starts) + torch.tensor(lens) - 1
        prefill = head(aux, nxt, AttentionMetadata.build(lens), from_target=True, logits_indices=last)
        torch.testing.assert_close(prefill.hidden, train, **TOL)
        torch.testing.assert_close(prefill.logits, head.compute_logits(train[last]), **TOL)
        kv, page_size = new_cache(head, 3), 3
        pages = [[] for _ in lens]
        out = torch.empty_like(train)
        for t in range(max(lens)):  # every row as its own decode step over the paged cache
            live = [b for b, n in enumerate(lens) if n > t]
            for b in live:
                kv.ensure(pages[b], t + 1)
            rows = torch.tensor([starts[b] + t for b in live])
            meta = AttentionMetadata.build([1] * len(live), [t + 1] * len(live), [pages[b] for b in live], page_size)
            out[rows] = head(aux[rows], nxt[rows], meta, kv.layers[0], from_target=True).hidden
        torch.testing.assert_close(out, train, **TOL)


@pytest.mark.parametrize("flags", [{}, EAGLE31, SPECULATORS], ids=["eagle3.0", "eagle3.1", "speculators"])
@pytest.mark.parametrize("type_", ["eagle3", "mtp"])
@pytest.mark.parametrize(("name", "lens"), [("qwen3", [6, 5]), ("mistral", [19])], ids=["qwen3", "mistral"])
def test_training_time_test_equals_what_draft_step_j_sees(tiny_checkpoints, name, lens, type_, flags):
    """Row i of unrolled step j (chain attention) = draft step j of a chain started at i over a paged cache:
    the cache holds the entries of positions 0..i computed from the target's aux features, step j > 0 feeds the
    previous output (eagle3: before its final norm, or after it with head.norm_output) with the next token at the
    next position. EAGLE-3.1's flags (an mtp head takes aux_norm only) act the same in both."""
    kw = dict(draft_vocab_size=64) if type_ == "eagle3" else dict(features="aux", aux_layers=[1, 3])
    if type_ == "mtp":
        flags = {k: v for k, v in flags.items() if k == "aux_norm"}
    head = build_head(HeadConfig.of(type=type_, **kw, **flags), tiny_checkpoints[name][0], dtype="float32")
    if flags:
        _perturb(head)
    steps, page_size = 3, 2
    aux, _, tokens = _aux_batch(tiny_checkpoints, name, head.aux_layers, lens)
    assert aux.shape[-1] == head.input_width
    with torch.no_grad():
        outs = head.unroll(aux, tokens, lens, steps, attention="chain")
        assert_unroll_is_the_inference_chain(head, aux, tokens, lens, outs, page_size, TOL)


def test_eagle3_feeds_its_pre_norm_output_to_the_next_step(tiny_checkpoints):
    head = _eagle3(tiny_checkpoints)
    aux, _, tokens = _aux_batch(tiny_checkpoints, "llama", head.aux_layers, [6])
    with torch.no_grad():
        outs = head.unroll(aux, tokens, [6], 2)
        meta = AttentionMetadata.build([6])
        again = head.unroll(aux, tokens, [6], 1)[0]
        torch.testing.assert_close(outs[0], again, **TOL)
        # The output is not normed: its RMS is not the norm's; the logits read norm(x).
        rms = outs[0].pow(2).mean(-1).sqrt()
        assert not torch.allclose(rms, torch.ones_like(rms), atol=0.05)
        logits = head(aux, packed_shift(tokens, [6], 1), meta, from_target=True, logits_indices=torch.arange(6)).logits
        torch.testing.assert_close(logits, head.norm(outs[0]) @ head.lm_head.weight.T, **TOL)


def test_norm_output_feeds_the_normed_output_to_the_next_step(tiny_checkpoints):
    head = _eagle3(tiny_checkpoints, norm_output=True)
    aux, _, tokens = _aux_batch(tiny_checkpoints, "llama", head.aux_layers, [6])
    with torch.no_grad():
        outs = head.unroll(aux, tokens, [6], 2)
        rms = outs[0].pow(2).mean(-1).sqrt()  # the final norm's weight starts at ones: RMS 1
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(head.logit_input(outs[0]), outs[0])  # the logits read it as is
        torch.testing.assert_close(outs[1].pow(2).mean(-1).sqrt(), torch.ones(6), rtol=1e-3, atol=1e-3)


def test_eagle31_flags_are_refused_where_they_mean_nothing(tiny_checkpoints):
    for type_ in ("mtp", "eagle1"):
        with pytest.raises(ValueError, match="head.aux_norm=true needs head.features=aux"):
            HeadConfig(type=type_, aux_norm=True)
        with pytest.raises(ValueError, match=f"head.norm_output is an eagle3 setting \\(head=eagle3\\); {type_} heads"):
            HeadConfig.of(type=type_, features="aux", norm_output=True)
    folder = tiny_checkpoints["llama"][0]
    mtp = build_head(HeadConfig(type="mtp", features="aux", aux_norm=True), folder, dtype="float32")
    with pytest.raises(LayoutError, match="head.aux_norm=true: the MTP layouts"):
        check_fits(mtp, "deepseek-mtp")
    e1 = build_head(HeadConfig(type="eagle1", features="aux", aux_norm=True), folder, dtype="float32")
    with pytest.raises(LayoutError, match="head.aux_norm=true: the EAGLE-1 layouts"):
        check_fits(e1, "vllm-eagle")
    with pytest.raises(LayoutError, match="head.norm_output=true: SGLang"):
        check_fits(_eagle3(tiny_checkpoints, norm_output=True), "sglang-eagle3")


def test_aux_feature_heads_are_refused_by_the_layouts_without_an_aux_fc(tiny_checkpoints):
    """An mtp / eagle1 head on the aux layers (head.features=aux) has no place in the final-hidden layouts: the
    refusal names the flag before any tensor is mapped, and the plain head still fits."""
    folder = tiny_checkpoints["llama"][0]
    for type_, formats in (("mtp", ("deepseek-mtp", "qwen3-next-mtp")), ("eagle1", ("vllm-eagle", "sglang-eagle"))):
        aux = build_head(HeadConfig(type=type_, features="aux"), folder, dtype="float32")
        plain = build_head(HeadConfig(type=type_), folder, dtype="float32")
        for fmt in formats:
            with pytest.raises(LayoutError, match="head.features=aux: the .* layouts .* export native"):
                check_fits(aux, fmt)
            check_fits(plain, fmt)


def test_mtp_aux_features_change_only_the_step0_input(tiny_checkpoints):
    base = build_head(HeadConfig(type="mtp"), tiny_checkpoints["llama"][0], dtype="float32")
    aux_head = build_head(HeadConfig(type="mtp", features="aux", aux_layers=[1, 3]), tiny_checkpoints["llama"][0],
                          dtype="float32")
    extra = set(aux_head.state_dict()) - set(base.state_dict())
    assert extra == {"aux_fc.weight"} and set(base.state_dict()) <= set(aux_head.state_dict())
    assert tuple(aux_head.aux_fc.weight.shape) == (64, 128)
    aux_head.load_state_dict({**base.state_dict(), "aux_fc.weight": aux_head.aux_fc.weight}, strict=True)
    aux, hidden, tokens = _aux_batch(tiny_checkpoints, "llama", [1, 3], [6])
    nxt = packed_shift(tokens, [6], 1)
    with torch.no_grad():
        # Fed its own H-wide output (steps j > 0), the aux head is the plain head.
        torch.testing.assert_close(aux_head.forward_train(hidden, nxt, [6], from_target=False),
                                   base.forward_train(hidden, nxt, [6]))
        via_fc = base.forward_train(aux_head.aux_fc(aux), nxt, [6])
        torch.testing.assert_close(aux_head.forward_train(aux, nxt, [6]), via_fc, **TOL)


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3.0", "eagle3.1"])
@pytest.mark.parametrize("type_", ["eagle3", "mtp"])
def test_save_load_round_trip_keeps_aux_layers_and_lm_head(tiny_checkpoints, tmp_path, type_, eagle31):
    folder = tiny_checkpoints["llama"][0]
    kw = dict(draft_vocab_size=64) if type_ == "eagle3" else dict(features="aux")
    flags = ({"aux_norm": True, **({"norm_output": True} if type_ == "eagle3" else {})}) if eagle31 else {}
    head = build_head(HeadConfig.of(type=type_, **kw, **flags), folder, dtype="float32")
    if eagle31:
        _perturb(head)
    if type_ == "eagle3":
        head.set_draft_vocab(torch.arange(100, 164))
        with torch.no_grad():
            head.lm_head.weight.mul_(2.0)
    save_head(head, tmp_path / "h", target_fingerprint=weights_fingerprint(folder))
    back = load_head(tmp_path / "h", folder, dtype="float32")
    assert back.aux_layers == head.aux_layers == [2, 1, 0]
    assert (back.cfg.aux_norm, back.cfg.settings) == (head.cfg.aux_norm, head.cfg.settings)
    assert ("aux_norm.2.weight" in back.state_dict()) == eagle31
    assert back.state_dict().keys() == head.state_dict().keys()
    for k, v in head.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)
    aux, _, tokens = _aux_batch(tiny_checkpoints, "llama", head.aux_layers, [5])
    with torch.no_grad():
        torch.testing.assert_close(back.unroll(aux, tokens, [5], 2)[1], head.unroll(aux, tokens, [5], 2)[1], **TOL)


# --- one aux layer: step 0 is known, not guessed from the width ----------------------------------------------------


@pytest.mark.parametrize("type_", ["eagle3", "mtp"])
def test_a_single_aux_layer_goes_through_the_aux_fc_in_training_and_inference(tiny_checkpoints, type_):
    """With head.aux_layers=[j] step 0's input is H wide, like every later step's: the head must still apply its aux
    fc there (the caller says which input it is), in the training forward, the unroll and the paged inference chain
    alike; a later step's H-wide input never goes through it."""
    kw = dict(draft_vocab_size=64) if type_ == "eagle3" else dict(features="aux")
    head = build_head(HeadConfig.of(type=type_, aux_layers=[2], **kw), tiny_checkpoints["llama"][0], dtype="float32")
    fc = head.fc if type_ == "eagle3" else head.aux_fc
    assert head.input_width == head.args.hidden_size and tuple(fc.weight.shape) == (head.args.hidden_size,) * 2
    with torch.no_grad():
        fc.weight.copy_(torch.eye(head.args.hidden_size) * 3.0)  # far from the identity a skipped fc would be
    aux, _, tokens = _aux_batch(tiny_checkpoints, "llama", [2], [6, 4])
    nxt = packed_shift(tokens, [6, 4], 1)
    with torch.no_grad():
        step0 = head.forward_train(aux, nxt, [6, 4])
        skipped = head.forward_train(aux, nxt, [6, 4], from_target=False)  # the same rows read as a later step's
        through_fc = head.forward_train(3.0 * aux, nxt, [6, 4], from_target=False)
        assert not torch.allclose(step0, skipped, **TOL)
        torch.testing.assert_close(step0, through_fc, **TOL)
        outs = head.unroll(aux, tokens, [6, 4], 3, attention="chain")
        torch.testing.assert_close(outs[0], step0, **TOL)
        assert_unroll_is_the_inference_chain(head, aux, tokens, [6, 4], outs, 2, TOL)


def test_a_single_aux_layer_head_serves_through_its_fc_and_exports_where_a_layout_takes_it(tiny_checkpoints,
                                                                                            tmp_path):
    """An eagle3 head over one aux layer: the native export equals the head on step-0 rows, the serving engines'
    EAGLE-3 layouts refuse it by name (their fc reads exactly three layers), and greedy speculative decoding with
    it equals plain decoding (the engine catches up on that one layer through the fc)."""
    from mtp_train.engine import LLMEngine, SamplingParams
    from mtp_train.export import export_head, verify_round_trip
    from mtp_train.head_types.chain import HeadProposer
    from mtp_train.speculative.engine import SpecEngine

    folder = tiny_checkpoints["llama"][0]
    head = build_head(HeadConfig(type="eagle3", draft_vocab_size=64, aux_layers=[2]), folder, dtype="float32")
    save_head(head, tmp_path / "head", target_fingerprint=weights_fingerprint(folder))
    out = export_head(tmp_path / "head", folder, "native", tmp_path / "native")
    assert verify_round_trip(tmp_path / "head", out, folder) == 0.0
    for fmt in ("speculators", "sglang-eagle3"):
        with pytest.raises(LayoutError, match=r"aux_layers=\[2\]: the engines read exactly 3 target layers"):
            export_head(tmp_path / "head", folder, fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()
    model = load_model(folder, dtype="float32", backend="torch")
    prompts = [[5, 9, 11, 3], [7, 2, 8]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = LLMEngine(model, page_size=3, num_pages=128).generate(prompts, params)
    spec = SpecEngine(model, HeadProposer(head), 3, page_size=3, num_pages=128).generate(prompts, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]


@pytest.mark.parametrize("flags", [SPECULATORS, dict(norm_before_residual=True)], ids=["speculators", "nbr"])
def test_greedy_speculative_decoding_with_speculators_settings_equals_plain_decoding(tiny_checkpoints, flags):
    """A head with speculators' switches (perturbed, so its drafts are neither all accepted nor all refused) drafts
    through the engine, native steps included: the greedy answers are plain decoding's."""
    from mtp_train.engine import LLMEngine, SamplingParams
    from mtp_train.head_types.chain import HeadProposer
    from mtp_train.speculative.engine import SpecEngine

    head = _eagle3(tiny_checkpoints, **flags)
    _perturb(head)
    model = load_model(tiny_checkpoints["llama"][0], dtype="float32", backend="torch")
    prompts = [[5, 9, 11, 3], [7, 2, 8], [1, 4, 4, 4, 6, 2]]
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    plain = LLMEngine(model, page_size=3, num_pages=128).generate(prompts, params)
    spec = SpecEngine(model, HeadProposer(head), 3, page_size=3, num_pages=128).generate(prompts, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]


def test_speculators_settings_survive_save_and_load(tiny_checkpoints, tmp_path):
    """The three switches are saved with the head (its config.json, flat) and reloaded: the same tensors (the
    whole-input norm among them), the lm_head still frozen, the same unroll."""
    folder = tiny_checkpoints["llama"][0]
    head = _eagle3(tiny_checkpoints, **SPECULATORS)
    _perturb(head)
    head.set_draft_vocab(torch.arange(100, 164))  # the frozen rows follow the draft vocabulary
    save_head(head, tmp_path / "h", target_fingerprint=weights_fingerprint(folder))
    saved = json.loads((tmp_path / "h" / "config.json").read_text())
    assert {k: saved.get(k, (saved.get("head") or {}).get(k)) for k in SPECULATORS} == SPECULATORS
    back = load_head(tmp_path / "h", folder, dtype="float32")
    assert back.cfg.settings == head.cfg.settings and not back.lm_head.weight.requires_grad
    assert back.state_dict().keys() == head.state_dict().keys() and "fc_input_norm.weight" in back.state_dict()
    for k, v in head.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)
    torch.testing.assert_close(back.lm_head.weight, back.frozen.lm_head[100:164], rtol=0, atol=0)
    aux, _, tokens = _aux_batch(tiny_checkpoints, "llama", head.aux_layers, [5])
    with torch.no_grad():
        torch.testing.assert_close(back.unroll(aux, tokens, [5], 2)[1], head.unroll(aux, tokens, [5], 2)[1], **TOL)
