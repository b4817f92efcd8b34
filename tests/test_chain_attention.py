"""The chained training attention's two modes: `diagonal` (nothing n × n kept: one causal SDPA per step, the own keys
folded in as one extra key; banded blocks under a sliding window) gives `masked`'s attention over all (j+1)·n keys,
forward and backward, and keeps memory linear in n; a step recomputed under activation checkpointing is the same
step again."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import profile
from torch.utils.checkpoint import checkpoint

from bench.attention_memory import chain_saved
from checks.gpu.chain_attention import chain_attention_check
from checks.gpu.common import Checks
from mtp_train.heads.chain_attention import ChainTrainAttention, attend_chain
from mtp_train.layers import AttentionMetadata


def _qkv(heads: tuple[int, int], d: int, dv: int, t: int, steps: int, g: torch.Generator,
         dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, ...]]:
    """Per step (q (t, Hq, d), k (t, Hkv, d), v (t, Hkv, dv)), leaves that require grad."""
    return [tuple((torch.randn(t, h, w, generator=g) * 2).to(dtype).requires_grad_()
                  for h, w in ((heads[0], d), (heads[1], d), (heads[1], dv))) for _ in range(steps)]


def _run(mode: str, qkv: list[tuple[torch.Tensor, ...]], lens: list[int], window: int | None,
         weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """One unroll's outputs and the gradients of Σ outputs · weights for every q, k, v."""
    q0, k0, _ = qkv[0]
    outs = attend_chain(ChainTrainAttention(q0.shape[1], k0.shape[1], q0.shape[2], window, mode), qkv, lens)
    loss = sum((o.float() * w).sum() for o, w in zip(outs, weights))
    return outs, torch.autograd.grad(loss, [x for step in qkv for x in step])


@pytest.mark.parametrize(("heads", "dv", "window", "lens", "steps"), [
    ((6, 2), 16, None, [7, 5, 1], 5),
    ((4, 4), 16, 3, [7, 5, 1], 5),  # the window hides step-0 keys, then the row's own older keys
    ((4, 1), 8, None, [7, 5, 1], 5),  # MLA: values (the latent) narrower than the keys
    ((6, 2), 16, 100, [300, 150, 1], 4),  # banded blocks: the first ones alone, the rest as one batch
    ((4, 1), 8, 70, [200, 9], 3),
], ids=["gqa", "window", "latent-values", "long-window", "latent-window"])
def test_diagonal_mode_is_the_masked_attention_forward_and_backward(heads, dv, window, lens, steps):
    g = torch.Generator().manual_seed(0)
    qkv = _qkv(heads, 16, dv, sum(lens), steps, g)
    weights = [torch.randn(sum(lens), heads[0], dv, generator=g) for _ in range(steps)]
    masked, diagonal = (_run(mode, qkv, lens, window, weights) for mode in ("masked", "diagonal"))
    for a, b in zip(masked[0], diagonal[0], strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for a, b in zip(masked[1], diagonal[1], strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 40])
def test_bf16_diagonal_is_as_close_to_float32_as_masked(window):
    """In bf16 the folded group's score rides in two columns (high and low part), so diagonal's error against the
    float32 attention stays that of bf16 itself (masked's)."""
    g = torch.Generator().manual_seed(1)
    lens, steps = [90, 7], 3
    ref = _qkv((6, 2), 16, 16, sum(lens), steps, g)
    weights = [torch.randn(sum(lens), 6, 16, generator=g) for _ in range(steps)]
    exact = _run("masked", ref, lens, window, weights)
    low = [tuple(x.detach().bfloat16().requires_grad_() for x in step) for step in ref]
    errs = {}
    for mode in ("masked", "diagonal"):
        outs, grads = _run(mode, low, lens, window, weights)
        errs[mode] = (max((o.float() - e).abs().max().item() for o, e in zip(outs, exact[0])),
                      max((a.float() - e).abs().max().item() / e.abs().max().item()
                          for a, e in zip(grads, exact[1])))
    assert errs["diagonal"][0] <= 2 * errs["masked"][0] + 1e-3, errs
    assert errs["diagonal"][1] <= 2 * errs["masked"][1] + 1e-3, errs


@pytest.mark.parametrize("window", [None, 48])
def test_memory_grows_linearly_and_nothing_n_by_n_is_kept(window):
    """The bytes autograd saves for a 3-step unroll's attention at n = 2048 and 4096: about twice (the masked
    reference's ~3.4x), and no saved storage as large as n × n."""
    (small, big_small), (large, big_large) = (chain_saved(n, 3, "diagonal", window) for n in (2048, 4096))
    assert large / small < 2.3, (small, large)
    assert big_small < 2048 ** 2 and big_large < 4096 ** 2
    masked, biggest = chain_saved(2048, 3, "masked", window)
    assert biggest >= 2048 ** 2 and masked > small  # the count sees what the dense reference keeps


@pytest.mark.parametrize(("heads", "dv", "window"), [((9, 3), 64, None), ((9, 3), 64, 100), ((4, 1), 48, None)],
                         ids=["gqa", "window", "latent-values"])
def test_cpu_runs_the_flash_kernel_never_the_math_one(heads, dv, window):
    """CPU's flash SDPA keeps q, k, v, the output and its logsumexp; the math kernel would keep the scores."""
    qkv = _qkv(heads, 64, dv, 300, 3, torch.Generator().manual_seed(0))
    with profile() as prof:
        outs = attend_chain(ChainTrainAttention(heads[0], heads[1], 64, window), qkv, [300])
        sum(o.sum() for o in outs).backward()
    names = {e.name for e in prof.events()}
    assert {"aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= names
    assert "aten::_scaled_dot_product_attention_math" not in names


@pytest.mark.parametrize("begin_inside", [True, False], ids=["begin-step-inside", "begin-step-outside"])
@pytest.mark.parametrize("window", [None, 6])
def test_a_checkpointed_unroll_gives_the_same_outputs_and_gradients(begin_inside, window):
    """Each step under non-reentrant checkpointing is recomputed in the backward: it stores its K/V at its own
    index again and attends steps 0..j only, whether the unroll calls `begin_step` inside the checkpointed
    function or before it (the step's metadata remembers it)."""
    hq, hkv, d, lens, steps = 4, 2, 8, [9, 4], 3
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(hq * d, (hq + 2 * hkv) * d, generator=g) * 0.2).requires_grad_()
    x0 = torch.randn(sum(lens), hq * d, generator=g).requires_grad_()
    weights = [torch.randn(sum(lens), hq, d, generator=g) for _ in range(steps)]

    def unroll(ckpt: bool) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        attn = ChainTrainAttention(hq, hkv, d, window)
        x, outs = x0, []
        for j in range(steps):
            meta = AttentionMetadata.build(lens)
            meta.positions = meta.positions + j

            def step(x: torch.Tensor, w: torch.Tensor, j: int = j, meta: AttentionMetadata = meta) -> torch.Tensor:
                if begin_inside:
                    attn.begin_step(j)
                q, k, v = (torch.tanh(x) @ w).split([hq * d, hkv * d, hkv * d], -1)
                t = x.shape[0]
                return attn.forward(q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d), None, meta)

            if not begin_inside:
                attn.begin_step(j)
            out = checkpoint(step, x, w, use_reentrant=False) if ckpt else step(x, w)
            outs.append(out)
            x = out.reshape(out.shape[0], -1)  # the next step reads this one's output, as the unroll does
        loss = sum((o * c).sum() for o, c in zip(outs, weights))
        return [o.detach() for o in outs], torch.autograd.grad(loss, [w, x0])

    plain, ckpt = unroll(False), unroll(True)
    for a, b in zip(plain[0], ckpt[0], strict=True):
        torch.testing.assert_close(b, a)
    for a, b in zip(plain[1], ckpt[1], strict=True):
        torch.testing.assert_close(b, a)


def test_begin_step_refuses_a_step_whose_predecessors_have_not_run():
    attn = ChainTrainAttention(4, 2, 8)
    with pytest.raises(ValueError, match="chain step 2 cannot run: steps 0..-1 have run, so the next is at most 0"):
        attn.begin_step(2)


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown chain attention mode 'dense'.*diagonal, masked"):
        ChainTrainAttention(4, 2, 8, mode="dense")


def test_the_gpu_checks_chain_attention_section_runs_on_the_cpu(capsys):
    """checks.gpu's chain-attention group as a dry run on the CPU (float32, small shapes, one round): the modes
    agree, and its record line carries both modes' times per shape."""
    check = Checks()
    chain_attention_check(check, device="cpu", dtype=torch.float32, lens=(9, 4), steps=3,
                          shapes=(("tiny", 4, 2, 8),), rounds=1)
    assert [(name, ok) for name, ok, _ in check.results] == [
        ("chain attention tiny (4/2 heads of 8), 3 steps: diagonal = masked", True)]
    line = next(json.loads(x.split(" ", 1)[1]) for x in capsys.readouterr().out.splitlines()
                if x.startswith("CHAIN_ATTENTION "))
    assert line["steps"] == 3 and line["lens"] == [9, 4]
    assert {"masked_ms", "diagonal_ms", "masked_over_diagonal"} <= set(line["tiny"])
