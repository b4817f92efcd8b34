"""Acceptance rules: greedy equals the target's argmax chain; stochastic reproduces the target distribution."""

from __future__ import annotations

import pytest
import torch

from mtp_train.speculative import accept_greedy, accept_stochastic


def test_greedy_accepts_the_matching_prefix_and_adds_the_target_token():
    draft = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    target_ids = torch.tensor([[1, 2, 0, 5], [0, 5, 6, 1], [7, 8, 9, 4]])
    logits = torch.nn.functional.one_hot(target_ids, 10).float()
    res = accept_greedy(draft, logits)
    assert res.num_accepted == [2, 0, 3]
    assert res.tokens == [[1, 2, 0], [0], [7, 8, 9, 4]]


def _chi_square(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_stochastic_acceptance_reproduces_the_target_distribution():
    """Chi-square on a 5-token vocabulary: emitted tokens follow p, whatever the draft's q (fixed seed)."""
    torch.manual_seed(0)
    v, k, n = 5, 3, 20000
    p = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05])
    q = torch.tensor([0.10, 0.20, 0.30, 0.25, 0.15])  # a poor draft: most mass where p has little
    g = torch.Generator().manual_seed(1)
    draft = torch.multinomial(q.expand(n * k, v), 1, replacement=True, generator=g).view(n, k)
    res = accept_stochastic(draft, q.expand(n, k, v), p.expand(n, k + 1, v), [g] * n)
    first = torch.tensor([t[0] for t in res.tokens])
    second = torch.tensor([t[1] for t in res.tokens if len(t) > 1])
    # df = 4: the 0.1% critical value is 18.47
    assert _chi_square(first, p) < 18.47
    assert _chi_square(second, p) < 18.47
    # the acceptance probability of one draft token is sum_x min(p, q)
    rate = sum(res.num_accepted) / (n * k)
    assert 0.25 < rate < torch.minimum(p, q).sum().item() + 0.02


def test_identical_draft_and_target_accept_everything():
    v, k, n = 4, 3, 50
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    g = torch.Generator().manual_seed(3)
    draft = torch.multinomial(p.expand(n * k, v), 1, replacement=True, generator=g).view(n, k)
    res = accept_stochastic(draft, p.expand(n, k, v), p.expand(n, k + 1, v), [g] * n)
    assert res.num_accepted == [k] * n
    assert all(t[:k] == d for t, d in zip(res.tokens, draft.tolist()))


def test_seeded_acceptance_is_reproducible():
    v, k, n = 6, 4, 16
    torch.manual_seed(5)
    p = torch.softmax(torch.randn(n, k + 1, v), -1)
    q = torch.softmax(torch.randn(n, k, v), -1)
    draft = torch.randint(0, v, (n, k))

    def run():
        return accept_stochastic(draft, q, p, [torch.Generator().manual_seed(i) for i in range(n)])

    assert run() == run()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer's fused speculative sampling needs CUDA")
def test_flashinfer_chain_sampling_reproduces_the_target_distribution():
    pytest.importorskip("flashinfer")
    from mtp_train.speculative.acceptance import accept_stochastic_flashinfer

    torch.manual_seed(0)
    v, k, n = 5, 3, 20000
    p = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05], device="cuda")
    q = torch.tensor([0.10, 0.20, 0.30, 0.25, 0.15], device="cuda")
    draft = torch.multinomial(q.expand(n * k, v), 1, replacement=True).view(n, k)
    res = accept_stochastic_flashinfer(draft, q.expand(n, k, v), p.expand(n, k + 1, v))
    first = torch.tensor([t[0] for t in res.tokens])
    assert _chi_square(first, p.cpu()) < 18.47
    assert all(len(t) == a + 1 for t, a in zip(res.tokens, res.num_accepted))
