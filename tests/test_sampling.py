"""Sampling: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

import pytest
import torch

from mtp_train.engine import SamplingBatch, SamplingParams, filtered_probs, sample


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    assert sample(logits, SamplingBatch([SamplingParams(), SamplingParams()])).tolist() == [1, 0]
    assert filtered_probs(logits, 0.0).tolist() == [[0, 1, 0], [1, 0, 0]]


def test_greedy_ids_are_argmax_ties_and_nan_included():
    """`greedy_ids` (max's kernel) gives argmax's first maximal index: on ties, NaN rows, all-equal and -inf rows,
    and on wide rows of many ties."""
    from mtp_train.engine.sampling import greedy_ids

    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 0.0], [2.0, nan, 5.0, 5.0], [0.0] * 4, [-inf] * 4])
    assert greedy_ids(x).tolist() == x.argmax(-1).tolist() == [1, 0, 1, 0, 0]
    g = torch.Generator().manual_seed(0)
    for shape in [(7, 49152), (3, 8195), (5, 1)]:
        y = torch.randint(0, 5, shape, generator=g).float()
        assert torch.equal(greedy_ids(y), y.argmax(-1))
    assert greedy_ids(torch.tensor([0.5, 2.0, 2.0])).item() == 1  # one row, no batch dimension


def test_top_k_and_top_p_filter():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = filtered_probs(logits, 1.0, top_k=2)
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top_p 0.8: 0.5 + 0.3 reaches 0.8, so the tail is dropped
    p = filtered_probs(logits, 1.0, top_p=0.8)
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top_p below the first token's mass still keeps that token
    assert filtered_probs(logits, 1.0, top_p=0.1).tolist() == [1.0, 0.0, 0.0, 0.0]
    # temperature flattens
    assert filtered_probs(logits, 2.0)[3] > filtered_probs(logits, 1.0)[3]


def test_seeded_sampling_is_reproducible_and_follows_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(1, 3)
    params = SamplingParams(temperature=1.0, seed=123)

    def draw(n):
        g = params.make_generator()
        return [sample(logits, SamplingBatch([params], [g])).item() for _ in range(n)]

    a, b = draw(2000), draw(2000)
    assert a == b
    freq = torch.bincount(torch.tensor(a), minlength=3).float() / 2000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_new_tokens=0)])
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
