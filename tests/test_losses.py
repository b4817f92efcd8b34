"""The head loss: alignment and masking, normalisation, vocabulary chunking, metrics, unrolled steps, a tiny overfit."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from mtp_train.config import HeadConfig, LossConfig
from mtp_train.engine import prefill_hidden
from mtp_train.heads import build_head
from mtp_train.layers import cpu_kernels
from mtp_train.models import load_model
from mtp_train.train.losses import (
    chunked_soft_ce,
    chunked_token_loss,
    draft_loss,
    step_targets,
    step_token_counts,
    unrolled_loss,
)

V, H = 96, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def _rand(*shape, seed: int, scale: float = 1.0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


def _reference(pred, target, lm_head):
    """Unchunked soft CE (summed) and top-1 / top-3 counts, straight from the definition."""
    z, t = pred @ lm_head.T, target @ lm_head.T  # (N, V)
    ce = -(t.softmax(-1) * z.log_softmax(-1)).sum()
    best = t.argmax(-1)
    top3 = z.topk(3, -1).indices
    return ce, (top3[:, 0] == best).sum(), (top3 == best[:, None]).any(-1).sum()


@pytest.fixture(scope="module")
def tiny_batch(tiny_checkpoints):
    """A head on the tiny llama target and a packed batch of its real hidden states with an assistant-like mask."""
    path = tiny_checkpoints["llama"][0]
    target = load_model(path, dtype="float32", backend="torch")
    g = torch.Generator().manual_seed(0)
    lens = [13, 11]
    seqs = [torch.randint(0, target.args.vocab_size, (n,), generator=g).tolist() for n in lens]
    hidden = prefill_hidden(target, seqs).hidden
    ids = torch.tensor([t for s in seqs for t in s])
    mask = torch.cat([torch.tensor([0] * 3 + [1] * (n - 3)) for n in lens])  # a 3-token "prompt" per sequence
    return path, hidden, ids, mask, lens


# --- alignment --------------------------------------------------------------------------------------------------


def test_step_targets_and_counts_by_hand():
    lens = [4, 3]
    hidden = torch.arange(7.0)[:, None].repeat(1, 2)  # row r holds r
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 0])
    t0, c0 = step_targets(hidden, mask, lens, 0)
    assert t0[:, 0].tolist() == [1, 2, 3, 0, 5, 6, 0]  # h_{i+1}, nothing after a sequence's end
    assert c0.tolist() == [True, True, True, False, True, False, False]  # mask[i+1], never past the end
    t1, c1 = step_targets(hidden, mask, lens, 1)
    assert t1[:, 0].tolist() == [2, 3, 0, 0, 6, 0, 0]
    assert c1.tolist() == [True, True, False, False, False, False, False]
    assert step_token_counts(mask, lens, 3).tolist() == [4.0, 2.0, 1.0]


# --- the chunked soft cross-entropy -----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
@pytest.mark.parametrize("chunk", [1, 5, 23, 1000])
def test_chunked_soft_ce_equals_unchunked_value_and_gradient(impl, chunk):
    lm_head = _rand(V, H, seed=0, scale=0.5)
    target = _rand(23, H, seed=1)
    pred = (target + _rand(23, H, seed=2, scale=0.5)).requires_grad_(True)
    ref_pred = pred.detach().clone().requires_grad_(True)
    ce, top1, top3 = chunked_soft_ce(pred, target, lm_head, chunk_size=chunk, impl=impl)
    ref_ce, ref_top1, ref_top3 = _reference(ref_pred, target, lm_head)
    torch.testing.assert_close(ce, ref_ce)
    assert (top1.item(), top3.item()) == (ref_top1.item(), ref_top3.item())
    assert 0 < top1 < top3 < 23  # a test that can tell top-1 from top-3
    (2.5 * ce).backward()
    (2.5 * ref_ce).backward()
    torch.testing.assert_close(pred.grad, ref_pred.grad)


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
def test_no_full_vocabulary_tensor_is_kept_for_backward(impl):
    """Autograd keeps no (rows > chunk, V) tensor: the logits exist one chunk at a time."""
    lm_head, target = _rand(V, H, seed=0), _rand(40, H, seed=1)
    pred = _rand(40, H, seed=2).requires_grad_(True)
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _reference(pred, target, lm_head)
    assert (40, V) in saved  # the hook sees what the naive computation keeps
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ce, _, _ = chunked_soft_ce(pred, target, lm_head, chunk_size=8, impl=impl)
    assert saved and not [s for s in saved if s[-1] == V and s[0] > 8]
    ce.backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all()


@pytest.mark.parametrize("own_head", [False, True])
def test_fused_float32_native_path_equals_torch_path(own_head, monkeypatch):
    """fp32 on CPU the fused CE runs its per-row work in native code; value, counts and gradients equal torch's."""
    if not cpu_kernels.available():
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    calls = []
    native_ce = cpu_kernels.soft_ce_
    monkeypatch.setattr(cpu_kernels, "soft_ce_", lambda z, t: calls.append(z.shape) or native_ce(z, t))
    lm_head = _rand(V, H, seed=0, scale=0.5, dtype=torch.float32)
    target = _rand(23, H, seed=1, dtype=torch.float32)
    pred0 = target + _rand(23, H, seed=2, scale=0.5, dtype=torch.float32)
    own0 = lm_head + _rand(V, H, seed=3, scale=0.05, dtype=torch.float32) if own_head else None
    results = []
    for native in (True, False):
        pred = pred0.clone().requires_grad_(True)
        own = own0.clone().requires_grad_(True) if own_head else None
        with nullcontext() if native else cpu_kernels.disabled():
            ce, top1, top3 = chunked_soft_ce(pred, target, lm_head, chunk_size=5, impl="fused", pred_head=own)
        (2.5 * ce).backward()
        results.append((ce.detach(), top1.item(), top3.item(), pred.grad, None if own is None else own.grad))
    assert calls == [(5, V)] * 4 + [(3, V)]  # the native rows ran once, chunk by chunk; the torch run not at all
    (ce_n, *counts_n, g_n, w_n), (ce_t, *counts_t, g_t, w_t) = results
    torch.testing.assert_close(ce_n, ce_t)
    assert counts_n == counts_t and 0 < counts_n[0] < counts_n[1] < 23
    torch.testing.assert_close(g_n, g_t)
    if own_head:
        torch.testing.assert_close(w_n, w_t)


def test_bf16_chunked_matches_unchunked():
    lm_head, target = _rand(V, H, seed=0, dtype=torch.bfloat16), _rand(30, H, seed=1, dtype=torch.bfloat16)
    pred = _rand(30, H, seed=2, dtype=torch.bfloat16).requires_grad_(True)
    full, _, _ = chunked_soft_ce(pred, target, lm_head, chunk_size=10**6)
    for impl in ("checkpoint", "fused"):
        ce, _, _ = chunked_soft_ce(pred, target, lm_head, chunk_size=7, impl=impl)
        torch.testing.assert_close(ce, full, rtol=1e-5, atol=1e-4)


# --- the step loss ----------------------------------------------------------------------------------------------


def _step_loss_inputs(seed: int = 0):
    lm_head = _rand(V, H, seed=seed, scale=0.5)
    target = _rand(20, H, seed=seed + 1)
    pred = target + _rand(20, H, seed=seed + 2, scale=0.7)
    counted = torch.rand(20, generator=torch.Generator().manual_seed(seed + 3)) < 0.6
    return pred, target, counted, lm_head


def test_masked_rows_contribute_nothing():
    pred, target, counted, lm_head = _step_loss_inputs()
    p1 = pred.clone().requires_grad_(True)
    loss1, m1 = draft_loss(p1, target, counted, lm_head, chunk_size=4)
    loss1.backward()
    p2, t2 = pred.clone(), target.clone()
    p2[~counted], t2[~counted] = float("nan"), 1e6  # anything at all in the rows that are not counted
    p2.requires_grad_(True)
    loss2, m2 = draft_loss(p2, t2, counted, lm_head, chunk_size=4)
    loss2.backward()
    torch.testing.assert_close(loss2, loss1, rtol=0, atol=0)
    assert m1 == m2 or all(torch.equal(m1[k], m2[k]) for k in m1)
    torch.testing.assert_close(p2.grad, p1.grad, rtol=0, atol=0)
    assert (p1.grad[~counted] == 0).all() and (p1.grad[counted] != 0).any()


def test_normalised_by_num_tokens_and_additive_over_ranks():
    pred, target, counted, lm_head = _step_loss_inputs()
    n = int(counted.sum())
    loss, m = draft_loss(pred, target, counted, lm_head, w_feat=1.0, w_tok=0.1)
    feat = F.smooth_l1_loss(pred[counted].float(), target[counted].float(), reduction="none").mean(-1).sum()
    ce = _reference(pred[counted], target[counted], lm_head)[0]
    torch.testing.assert_close(loss, (feat + 0.1 * ce) / n)
    assert m["num_tokens"].item() == n
    half, mh = draft_loss(pred, target, counted, lm_head, num_tokens=2 * n)
    torch.testing.assert_close(half, loss / 2)
    torch.testing.assert_close(mh["top1"], m["top1"] / 2)

    # Two "ranks" holding half the rows each, normalised by the global count, add up to the whole batch.
    parts = [slice(0, 9), slice(9, 20)]
    p = pred.clone().requires_grad_(True)
    total = sum(draft_loss(p[s], target[s], counted[s], lm_head, num_tokens=n)[0] for s in parts)
    total.backward()
    q = pred.clone().requires_grad_(True)
    whole, _ = draft_loss(q, target, counted, lm_head)
    whole.backward()
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(p.grad, q.grad)

    empty, me = draft_loss(pred.requires_grad_(True), target, torch.zeros(20, dtype=torch.bool), lm_head)
    assert empty.item() == 0 and me["num_tokens"].item() == 0
    empty.backward()  # still differentiable: a rank without counted rows takes part in the gradient exchange


def test_perfect_prediction_scores_top1_one_and_target_entropy():
    _, target, counted, lm_head = _step_loss_inputs()
    loss, m = draft_loss(target.clone(), target, counted, lm_head, w_feat=1.0, w_tok=1.0)
    assert m["top1"].item() == 1.0 and m["top3"].item() == 1.0 and m["feat_loss"].item() == 0.0
    p = (target[counted] @ lm_head.T).softmax(-1)
    entropy = -(p * p.log()).sum(-1).mean()
    torch.testing.assert_close(m["tok_loss"], entropy)
    torch.testing.assert_close(loss, m["tok_loss"])


# --- unrolled steps ---------------------------------------------------------------------------------------------


def test_unrolled_loss_weights_steps_and_reports_per_step_metrics(tiny_batch):
    path, hidden, ids, mask, lens = tiny_batch
    head = build_head(HeadConfig(type="mtp"), path, dtype="float32")
    cfg = LossConfig(steps=3, chunk_size=7)
    loss, m = unrolled_loss(head, hidden, ids, mask, lens, cfg)
    per_step = [m[f"step{j}/loss"] for j in range(3)]
    torch.testing.assert_close(loss.detach(), sum(0.8**j * x for j, x in enumerate(per_step)))
    counts = step_token_counts(mask, lens, 3)
    assert [m[f"step{j}/num_tokens"].item() for j in range(3)] == counts.tolist() == [18.0, 18.0, 18.0]
    for k in ("feat_loss", "tok_loss", "top1", "top3", "num_tokens"):
        assert all(f"step{j}/{k}" in m for j in range(3)) and torch.equal(m[k], m[f"step0/{k}"])
    # Each step's loss is the step loss of the unrolled prediction against h_{i+j+1}.
    preds = head.unroll(hidden, ids, lens, 3)
    target, counted = step_targets(hidden, mask, lens, 2)
    ref, _ = draft_loss(preds[2], target, counted, head.frozen.lm_head)
    torch.testing.assert_close(m["step2/loss"], ref.detach())
    # Explicit weights and global per-step counts pass straight through.
    cfg = LossConfig(steps=3, step_weights=[1.0, 0.0, 0.0])
    only0, m0 = unrolled_loss(head, hidden, ids, mask, lens, cfg, num_tokens=2 * counts)
    torch.testing.assert_close(only0.detach(), m["step0/loss"] / 2)
    loss.backward()
    assert all(p.grad is not None for p in head.parameters())
    with pytest.raises(ValueError, match="step_weights"):
        LossConfig(steps=2, step_weights=[1.0])


def test_feature_noise_only_in_training_mode(tiny_batch):
    path, hidden, ids, mask, lens = tiny_batch
    head = build_head(HeadConfig(type="eagle1"), path, dtype="float32")
    clean, _ = unrolled_loss(head, hidden, ids, mask, lens, LossConfig())
    noisy_cfg = LossConfig(noise_std=0.5)
    head.eval()
    assert unrolled_loss(head, hidden, ids, mask, lens, noisy_cfg)[0].item() == clean.item()
    head.train()
    a = unrolled_loss(head, hidden, ids, mask, lens, noisy_cfg, generator=torch.Generator().manual_seed(1))[0]
    b = unrolled_loss(head, hidden, ids, mask, lens, noisy_cfg, generator=torch.Generator().manual_seed(1))[0]
    assert a.item() == b.item() != clean.item()


@pytest.mark.parametrize("type_", ["mtp", "eagle1"])
def test_tiny_overfit(tiny_batch, type_):
    """A hundred Adam steps on one fixed batch: both loss terms collapse and top-1 beats the trivial baseline."""
    path, hidden, ids, mask, lens = tiny_batch
    torch.manual_seed(0)
    head = build_head(HeadConfig(type=type_), path, dtype="float32")
    cfg = LossConfig(steps=2, w_tok=1.0, chunk_size=8)
    target, counted = step_targets(hidden, mask, lens, 0)
    p = head.compute_logits(target[counted]).softmax(-1)
    # The tiny random target is nearly uniform: the soft CE can only fall to its entropy, so compare the excess.
    entropy = -(p * p.log()).sum(-1).mean()
    baseline = p.argmax(-1).bincount().max().item() / len(p)  # always guessing the most frequent target token
    opt = torch.optim.Adam(head.parameters(), lr=5e-3)
    first = None
    for _ in range(100):
        loss, m = unrolled_loss(head, hidden, ids, mask, lens, cfg)
        first = first if first is not None else m
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert m["loss"] < first["loss"]
    assert m["feat_loss"] < 0.05 * first["feat_loss"], (first["feat_loss"], m["feat_loss"])
    assert m["tok_loss"] - entropy < 0.05 * (first["tok_loss"] - entropy), (first["tok_loss"], m["tok_loss"], entropy)
    assert m["top1"] >= baseline + 0.5 and m["step1/top1"] >= baseline + 0.5, (baseline, m["top1"], m["step1/top1"])


# --- a head's own lm_head, the draft vocabulary, EAGLE-3's position mask ---------------------------------------


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
def test_a_trainable_head_side_lm_head_gets_its_gradient(impl):
    pred, target = _rand(17, 8, seed=1, scale=2.0).requires_grad_(), _rand(17, 8, seed=2, scale=2.0)
    target_w, own = _rand(11, 8, seed=3), _rand(11, 8, seed=4).requires_grad_()
    ce, top1, top3 = chunked_soft_ce(pred, target, target_w, chunk_size=5, impl=impl, pred_head=own)
    z, t = pred @ own.T, target @ target_w.T
    ref = -(t.softmax(-1) * z.log_softmax(-1)).sum()
    torch.testing.assert_close(ce, ref)
    assert int(top1) == int((z.argmax(-1) == t.argmax(-1)).sum())
    g_pred, g_own = torch.autograd.grad(ce, [pred, own])
    r_pred, r_own = torch.autograd.grad(ref, [pred, own])
    torch.testing.assert_close(g_pred, r_pred)
    torch.testing.assert_close(g_own, r_own)


def test_eagle3_loss_restricts_the_target_to_the_draft_rows_and_masks_out_of_vocab_argmax(tiny_batch):
    path, hidden, ids, mask, lens = tiny_batch
    head = build_head(HeadConfig(type="eagle3", draft_vocab_size=64, aux_layers=[1, 2, 3]), path, dtype="float32")
    head.set_draft_vocab(torch.arange(0, 256, 4))
    aux = _rand(hidden.shape[0], 3 * hidden.shape[1], seed=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="aux layers"):
        unrolled_loss(head, hidden, ids, mask, lens, LossConfig())
    plain, pm = unrolled_loss(head, hidden, ids, mask, lens, LossConfig(w_feat=0.0, w_tok=1.0), aux_hidden=aux)
    masked, mm = unrolled_loss(head, hidden, ids, mask, lens, LossConfig(w_feat=0.0, w_tok=1.0,
                                                                         mask_out_of_draft=True), aux_hidden=aux)
    # By hand: target softmax over the draft rows only, head logits from norm(out) @ own lm_head.
    out = head.unroll(aux, ids, lens, 1)[0]
    target, counted = step_targets(hidden, mask, lens, 0)
    rows = head.frozen.lm_head[head.draft_vocab]
    p = (target @ rows.T).softmax(-1)
    logq = (head.norm(out) @ head.lm_head.weight.T).log_softmax(-1)
    ce = -(p * logq).sum(-1)
    full_best = (target @ head.frozen.lm_head.T).argmax(-1)
    inside = torch.isin(full_best, head.draft_vocab)
    n = counted.sum()
    torch.testing.assert_close(plain, ce[counted].sum() / n)
    assert 0 < int((counted & inside).sum()) < int(n)  # the mask really drops rows here
    torch.testing.assert_close(masked, ce[counted & inside].sum() / n)  # still normalised by every loss row
    assert mm["num_tokens"] == pm["num_tokens"] == n
    masked.backward()
    assert head.lm_head.weight.grad is not None and head.fc.weight.grad is not None


# --- acceptance-aimed token losses (loss.kind) -----------------------------------------------------------------

KINDS = ("soft_ce", "rkl", "jsd", "tv", "nla", "lk_hybrid", "argmax_ce")


def _reference_kind(kind: str, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Row losses straight from the definitions, over probabilities (not log-probabilities) and the full vocabulary."""
    q, p = z.softmax(-1), t.softmax(-1)
    alpha = 1 - 0.5 * (p - q).abs().sum(-1)  # the TV form of α, not the min form the code uses
    kl_pq = (p * (p / q).log()).sum(-1)
    if kind == "soft_ce":
        return -(p * q.log()).sum(-1)
    if kind == "rkl":
        return (q * (q / p).log()).sum(-1)
    if kind == "jsd":
        m = (p + q) / 2
        return 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    if kind == "tv":
        return 1 - alpha
    if kind == "nla":
        return -alpha.log()
    if kind == "argmax_ce":
        return -q[torch.arange(len(q)), p.argmax(-1)].log()
    lam = torch.exp(-3 * alpha).detach()
    return lam * kl_pq + (1 - lam) * (1 - alpha)


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_token_loss_and_its_gradient_equal_a_plain_reference(kind, impl):
    """fp64 in, so any mistake in a formula or in the chunked gradient shows at tight tolerance."""
    pred, target = _rand(23, H, seed=1).requires_grad_(), _rand(23, H, seed=2)
    lm_head = _rand(V, H, seed=3, scale=0.5)
    loss, top1, _, alpha = chunked_token_loss(pred, target, lm_head, chunk_size=7, impl=impl, kind=kind)
    z, t = pred @ lm_head.T, target @ lm_head.T
    ref = _reference_kind(kind, z, t).sum()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(alpha, (1 - 0.5 * (z.softmax(-1) - t.softmax(-1)).abs().sum(-1)).sum().detach())
    assert int(top1) == int((z.argmax(-1) == t.argmax(-1)).sum())
    (g,) = torch.autograd.grad(loss, pred)
    (r,) = torch.autograd.grad(ref, pred)
    torch.testing.assert_close(g, r)


@pytest.mark.parametrize("kind", KINDS)
def test_each_token_loss_in_bf16_matches_its_float32_reference(kind):
    pred = _rand(19, H, seed=4, dtype=torch.float32).to(torch.bfloat16).requires_grad_()
    target = _rand(19, H, seed=5, dtype=torch.float32).to(torch.bfloat16)
    lm_head = _rand(V, H, seed=6, scale=0.5, dtype=torch.float32).to(torch.bfloat16)
    for impl in ("checkpoint", "fused"):
        loss, _, _, _ = chunked_token_loss(pred, target, lm_head, chunk_size=5, impl=impl, kind=kind)
        assert loss.dtype == torch.float32
        z, t = (pred @ lm_head.T).float(), (target @ lm_head.T).float()
        ref = _reference_kind(kind, z, t).sum()
        torch.testing.assert_close(loss, ref, rtol=2e-3, atol=2e-3)
        (g,) = torch.autograd.grad(loss, pred)
        (r,) = torch.autograd.grad(ref, pred)
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-3)


def test_acceptance_two_ways_and_its_limits():
    """α = Σ min(p, q) = 1 − TV(p, q); 1 for identical distributions; the LK blend is its KL end at α → 0."""
    from mtp_train.train.divergences import acceptance, row_loss

    z, t = _rand(6, V, seed=7), _rand(6, V, seed=8)
    a = acceptance(z.log_softmax(-1), t.log_softmax(-1))
    torch.testing.assert_close(a, 1 - 0.5 * (z.softmax(-1) - t.softmax(-1)).abs().sum(-1))
    same, alpha = row_loss("tv", t, t)
    torch.testing.assert_close(alpha, torch.ones(6, dtype=alpha.dtype))
    torch.testing.assert_close(same, torch.zeros(6, dtype=same.dtype))
    far = torch.full((1, 4), -30.0, dtype=torch.float64)
    far[0, 0], near = 30.0, torch.zeros(1, 4, dtype=torch.float64)
    near[0, 1] = 60.0  # disjoint mass: α ≈ 0, λ ≈ 1
    lk, _ = row_loss("lk_hybrid", far, near)
    kl = (near.softmax(-1) * (near.log_softmax(-1) - far.log_softmax(-1))).sum(-1)
    torch.testing.assert_close(lk, kl, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="unknown loss kind 'kl'"):
        row_loss("kl", z, t)
    with pytest.raises(ValueError, match="loss kind"):
        LossConfig(kind="kl")


@pytest.mark.parametrize("kind", KINDS[1:])
def test_every_token_loss_trains_a_head_towards_acceptance(tiny_batch, kind):
    """Sixty Adam steps on one fixed batch with each acceptance-aimed loss: the loss falls, top-1 rises, and so
    does α for every kind but the hard CE (it aims at the greedy match, not at α)."""
    path, hidden, ids, mask, lens = tiny_batch
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="mtp"), path, dtype="float32")
    cfg = LossConfig(steps=1, w_feat=0.0, w_tok=1.0, chunk_size=8, kind=kind, ce_impl="fused")
    opt = torch.optim.Adam(head.parameters(), lr=5e-3)
    first = None
    for _ in range(60):
        loss, m = unrolled_loss(head, hidden, ids, mask, lens, cfg)
        first = first if first is not None else m
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert m["loss"] < 0.8 * first["loss"], (first["loss"], m["loss"])
    if kind != "argmax_ce":  # the hard CE aims at the greedy match (top-1), not at α over this near-flat target
        assert m["alpha"] > first["alpha"] + 0.05, (first["alpha"], m["alpha"])
    assert m["top1"] > first["top1"], (first["top1"], m["top1"])


# --- per-row weights (D-PACE) -------------------------------------------------------------------------------------


def _dpace_by_hand(conf: list[list[float]], counted: list[list[bool]], a: float) -> list[list[float]]:
    """D-PACE's weights anchor by anchor with plain loops: w_j = m_j · Σ_{l ≥ j} m_l Π_{i ≤ l} s_i."""
    steps, rows = len(conf), len(conf[0])
    out = [[0.0] * rows for _ in range(steps)]
    for r in range(rows):
        s = [((1 - a) * conf[j][r] + a) if counted[j][r] else 1.0 for j in range(steps)]
        prefix = [1.0] * steps
        for j in range(steps):
            prefix[j] = s[j] * (prefix[j - 1] if j else 1.0)
        for j in range(steps):
            if counted[j][r]:
                out[j][r] = sum(prefix[m] for m in range(j, steps) if counted[m][r])
    return out


def test_dpace_weights_equal_the_formula_by_hand():
    from mtp_train.train.position_weights import dpace_weights

    g = torch.Generator().manual_seed(3)
    conf = torch.rand(4, 9, generator=g)
    counted = torch.rand(4, 9, generator=g) > 0.3
    for a in (0.5, 1.0, 0.1):
        ref = torch.tensor(_dpace_by_hand(conf.tolist(), counted.tolist(), a))
        torch.testing.assert_close(dpace_weights(conf, counted, a), ref)
    # a = 1: every draft is assumed to stand, so step j weighs the counted steps from j on (S − j without holes)
    full = dpace_weights(conf, torch.ones(4, 9, dtype=torch.bool), 1.0)
    assert full[:, 0].tolist() == [4.0, 3.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="must be"):
        dpace_weights(conf[0], counted[0], 0.5)
    with pytest.raises(ValueError, match="dpace_alpha"):
        LossConfig(position_weights="dpace", dpace_alpha=0.0)
    with pytest.raises(ValueError, match="position_weights"):
        LossConfig(position_weights="linear")


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
@pytest.mark.parametrize("kind", ["soft_ce", "tv", "lk_hybrid"])
def test_row_weights_scale_each_rows_loss_and_gradient(kind, impl):
    pred, target = _rand(23, H, seed=11).requires_grad_(), _rand(23, H, seed=12)
    lm_head = _rand(V, H, seed=13, scale=0.5)
    w = torch.rand(23, generator=torch.Generator().manual_seed(14), dtype=torch.float64) * 2
    loss, top1, _, alpha = chunked_token_loss(pred, target, lm_head, chunk_size=7, impl=impl, kind=kind, row_weight=w)
    rows = _reference_kind(kind, pred @ lm_head.T, target @ lm_head.T)
    ref = (rows * w).sum()
    torch.testing.assert_close(loss, ref)
    (g,) = torch.autograd.grad(loss, pred)
    (r,) = torch.autograd.grad(ref, pred)
    torch.testing.assert_close(g, r)
    _, top1_plain, _, alpha_plain = chunked_token_loss(pred, target, lm_head, chunk_size=7, impl=impl, kind=kind)
    assert int(top1) == int(top1_plain) and float(alpha) == pytest.approx(float(alpha_plain))  # counts unweighted


def test_fused_native_path_takes_row_weights(monkeypatch):
    """fp32 on CPU: the native soft-CE kernel's rows and gradient are weighted as the torch path's."""
    if not cpu_kernels.available():
        pytest.skip("native CPU kernels not built")
    pred = _rand(21, H, seed=15, dtype=torch.float32).requires_grad_()
    target, lm_head = _rand(21, H, seed=16, dtype=torch.float32), _rand(V, H, seed=17, scale=0.5, dtype=torch.float32)
    w = torch.rand(21, generator=torch.Generator().manual_seed(18))
    native = chunked_token_loss(pred, target, lm_head, chunk_size=8, impl="fused", row_weight=w)[0]
    (g_native,) = torch.autograd.grad(native, pred)
    monkeypatch.setattr(cpu_kernels, "serves", lambda *a: False)
    plain = chunked_token_loss(pred, target, lm_head, chunk_size=8, impl="fused", row_weight=w)[0]
    (g_plain,) = torch.autograd.grad(plain, pred)
    torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_native, g_plain, rtol=1e-5, atol=1e-6)


def test_dpace_unrolled_loss_weights_rows_by_the_heads_confidence(tiny_batch):
    """Under dpace each step's loss is the row-weighted step loss with the weights of `dpace_weights` on the head's
    own probability of the target's argmax; step weights are all 1; the mean weight is logged per step."""
    from mtp_train.train.position_weights import dpace_weights

    path, hidden, ids, mask, lens = tiny_batch
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="mtp"), path, dtype="float32")
    cfg = LossConfig(steps=3, chunk_size=7, position_weights="dpace", dpace_alpha=0.5)
    loss, m = unrolled_loss(head, hidden, ids, mask, lens, cfg)
    preds = head.unroll(hidden, ids, lens, 3)
    conf, counted, targets = [], [], []
    for j, pred in enumerate(preds):
        t, c = step_targets(hidden, mask, lens, j)
        z, zt = pred @ head.frozen.lm_head.T, t @ head.frozen.lm_head.T
        conf.append(z.softmax(-1).gather(1, zt.argmax(-1, keepdim=True)).squeeze(1).detach())
        counted.append(c)
        targets.append(t)
    w = dpace_weights(torch.stack(conf), torch.stack(counted), 0.5)
    assert float(w[0][counted[0]].min()) > float(w[2][counted[2]].max())  # earlier steps weigh more
    ref = sum(draft_loss(preds[j], targets[j], counted[j], head.frozen.lm_head, row_weight=w[j])[0] for j in range(3))
    torch.testing.assert_close(loss, ref)
    for j in range(3):
        torch.testing.assert_close(m[f"step{j}/pos_weight"], w[j][counted[j]].mean())
    loss.backward()
    assert all(p.grad is not None for p in head.parameters())


def test_dpace_trains_a_three_step_head(tiny_batch):
    path, hidden, ids, mask, lens = tiny_batch
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="mtp"), path, dtype="float32")
    cfg = LossConfig(steps=3, w_tok=1.0, chunk_size=8, position_weights="dpace", ce_impl="fused")
    opt = torch.optim.Adam(head.parameters(), lr=5e-3)
    first = None
    for _ in range(40):
        loss, m = unrolled_loss(head, hidden, ids, mask, lens, cfg)
        first = first if first is not None else m
        opt.zero_grad()
        loss.backward()
        opt.step()
    for j in range(3):
        assert m[f"step{j}/top1"] > first[f"step{j}/top1"], j
        assert m[f"step{j}/pos_weight"] > first[f"step{j}/pos_weight"], j  # more confidence, more weight


@pytest.mark.parametrize("kind", ["soft_ce", "rkl", "jsd", "tv", "nla", "lk_hybrid", "argmax_ce"])
def test_every_loss_kind_is_one_registered_token_loss_whose_two_paths_agree(kind):
    """One interface for every kind: `chunk_sums` (differentiable, the checkpoint path) and `chunk_grad` (the fused
    path: soft CE's closed form, natively on fp32 CPU; autograd for the others) give the same sums, and the closed
    form's gradient equals autograd's through `chunk_sums`; soft CE's rows equal its registered row loss."""
    from mtp_train.config.loss import TOKEN_LOSSES as DECLARED
    from mtp_train.train.divergences import TOKEN_LOSSES, TokenLoss, token_loss

    assert TOKEN_LOSSES is DECLARED and tuple(TOKEN_LOSSES) == (  # declared on the settings floor, filled here
        "soft_ce", "rkl", "jsd", "tv", "nla", "lk_hybrid", "argmax_ce")
    g = torch.Generator().manual_seed(3)
    z, t = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g) * 2
    rw = torch.rand(5, generator=g)
    loss = token_loss(kind)
    zg = z.clone().requires_grad_()
    sums = loss.chunk_sums(zg, t, rw)
    (want,) = torch.autograd.grad(sums[0], zg)
    got_sums, dz = loss.chunk_grad(z.clone(), t.clone(), rw)  # the native kernel may work in place
    for a, b in zip(got_sums, sums):
        torch.testing.assert_close(a.float(), b.detach().float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dz, want, rtol=1e-5, atol=1e-6)
    generic = TokenLoss(kind, loss.rows)  # the kind's row losses alone, through autograd
    torch.testing.assert_close(generic.chunk_sums(z, t, rw)[0], sums[0].detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=f"loss kind '{kind}' is registered twice"):
        TOKEN_LOSSES.add(TokenLoss(kind, loss.rows))


# --- a block drafter's token loss, rows grouped by target position ----------------------------------------------


def _block_head_batch(tiny_checkpoints, block_size: int = 8):
    """A dflash head with a 48-token draft vocabulary on the tiny llama target, and a packed batch whose anchors'
    blocks overlap (so most target positions are predicted by several (anchor, slot) rows)."""
    torch.manual_seed(0)
    head = build_head(HeadConfig.of(type="dflash", block_size=block_size, max_anchors=30, draft_vocab_size=48),
                      tiny_checkpoints["llama"][0], dtype="float32")
    head.set_draft_vocab(torch.randperm(head.args.vocab_size, generator=torch.Generator().manual_seed(1))[:48].sort()
                         .values)
    head.train()
    g = torch.Generator().manual_seed(2)
    lens = [29, 17, 23]
    ids = torch.randint(0, head.args.vocab_size, (sum(lens),), generator=g)
    mask = (torch.rand(sum(lens), generator=g) < 0.75).long()
    x = torch.randn(sum(lens), head.input_width, generator=g)
    hidden = torch.randn(sum(lens), head.args.hidden_size, generator=g)
    return head, hidden, ids, mask, lens, x


def test_target_chunks_group_rows_by_position_within_the_chunk_size(tiny_checkpoints):
    """`_target_chunks` orders a block drafter's rows by target position and cuts them into chunks of at most
    chunk_size rows; each chunk names its distinct positions once, so the target's lm_head runs on far fewer rows
    than the loss has (B = 8: 7 steps share each position)."""
    from mtp_train.train.losses import _target_chunks

    head, _, ids, mask, lens, _ = _block_head_batch(tiny_checkpoints)
    rows = head.loss_rows(ids, mask, lens, 3)
    own = torch.arange(ids.shape[0])
    pos = torch.cat([own[packed_counted(mask, lens, rows, j)] + j + 1 for j in range(head.drafts)])
    for size in (1, 5, 16, 4096):
        chunks = _target_chunks(pos, size)
        seen = torch.cat([r for r, _, _ in chunks])
        assert sorted(seen.tolist()) == list(range(pos.numel()))
        for r, u, inv in chunks:
            assert r.numel() <= size and bool((u[1:] > u[:-1]).all())
            assert torch.equal(u[inv], pos[r])
        if size == 4096:
            assert chunks[0][1].numel() < pos.numel() / 3  # one target row per distinct position


def packed_counted(mask, lens, rows, step):
    """Step `step`'s counted rows of a block drafter (`step_token_counts`'s rule), (T,) bool."""
    from mtp_train.heads import packed_shift

    return packed_shift(mask.bool(), lens, step + 1, fill=False) & rows


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
@pytest.mark.parametrize("chunk", [1, 5, 4096])
@pytest.mark.parametrize("native", [True, False])
def test_grouped_block_loss_equals_the_per_step_loss_with_out_of_draft_masking(tiny_checkpoints, monkeypatch, impl,
                                                                               chunk, native):
    """The position-grouped token loss (`grouped_token_losses`) against the step-by-step one on a dflash head with a
    draft vocabulary and loss.mask_out_of_draft (the local counts as normalisers), D-PACE, every chunk size from one
    row to the whole batch, through the native soft-CE kernel or torch's ops: the loss, the metrics and every
    gradient agree in float32."""
    if native and not cpu_kernels.available():
        pytest.skip("native CPU kernels not built")
    if not native:
        monkeypatch.setattr(cpu_kernels, "serves", lambda *a: False)
    head, hidden, ids, mask, lens, x = _block_head_batch(tiny_checkpoints)
    cfg = LossConfig(steps=head.drafts, w_feat=0.3, w_tok=1.0, position_weights="dpace", chunk_size=chunk,
                     ce_impl=impl, mask_out_of_draft=True)
    out = []
    for grouped in (True, False):
        head.zero_grad(set_to_none=True)
        loss, m = unrolled_loss(head, hidden, ids, mask, lens, cfg, aux_hidden=x, anchor_seed=5,
                                group_targets=grouped)
        loss.backward()
        out.append((loss.detach(), m, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (la, ma, ga), (lb, mb, gb) = out
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    assert float(ma["step0/num_tokens"]) > 0
    for k in ma:
        torch.testing.assert_close(ma[k].float(), mb[k].float(), rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")


@pytest.mark.parametrize("weighted", [False, True])
def test_soft_ce_torch_gradient_path_equals_autograd_in_place(weighted):
    """The fused path's torch ops (off fp32 CPU, or where the native pass is slower) give soft CE's sums and
    d/dz = softmax(z) - p as autograd does, while overwriting z with the gradient and t with p (no extra (C, V))."""
    from mtp_train.train.divergences import _soft_ce_grad_torch, accuracy_counts

    g = torch.Generator().manual_seed(3)
    z0, t0 = torch.randn(37, 301, generator=g) * 3, torch.randn(37, 301, generator=g) * 3
    rw = torch.rand(37, generator=g) if weighted else None
    zg = z0.clone().requires_grad_()
    p = t0.softmax(-1)
    rows = torch.logsumexp(zg, -1) - (p * zg).sum(-1)
    ce_ref = rows.sum() if rw is None else (rows * rw).sum()
    (dz_ref,) = torch.autograd.grad(ce_ref, zg)
    alpha_ref = torch.minimum(z0.softmax(-1), p).sum()
    top_ref = accuracy_counts(z0, p.argmax(-1))
    z, t = z0.clone(), t0.clone()
    (ce, top1, topk, alpha), dz = _soft_ce_grad_torch(z, t, rw)
    assert dz.data_ptr() == z.data_ptr()
    torch.testing.assert_close(ce, ce_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dz, dz_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alpha, alpha_ref, rtol=1e-5, atol=1e-5)
    assert (int(top1), int(topk)) == (int(top_ref[0]), int(top_ref[1]))
    torch.testing.assert_close(t, p)
