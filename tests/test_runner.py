"""The model runner over the paged cache: decode and verify equal a full recompute."""

from __future__ import annotations

import pytest
import torch

from mtp_train.engine import ModelRunner, Sequence, StepRows, prefill_hidden
from mtp_train.models import load_model
from mtp_train.speculative.tree import DraftTree, layout


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_model(tiny_checkpoints["llama"][0], dtype="float32", backend="torch")


def _full_logits(model, tokens):
    """Logits of the last token computed from scratch, without any cache."""
    out = prefill_hidden(model, [tokens])
    return model.compute_logits(out.hidden[-1:])[0]


def test_decode_through_small_pages_equals_full_recompute(model):
    runner = ModelRunner.create(model, num_pages=64, page_size=3)  # small pages: boundaries crossed often
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence.new(i, torch.randint(0, 256, (n,), generator=g).tolist()) for i, n in enumerate((2, 7, 12, 5))]
    out = runner.run(seqs)  # packed prompt prefill
    for step in range(22):
        nxt = out.logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.token_ids.append(t)
        out = runner.run(seqs)  # one decode step for all
        for b, s in enumerate(seqs):
            torch.testing.assert_close(out.logits[b], _full_logits(model, s.token_ids), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, s=s, step=step: f"seq {s.seq_id} step {step}: {m}")
    assert all(len(s.pages) == -(-len(s) // 3) for s in seqs)


@pytest.mark.parametrize("k", [2, 4, 7])
def test_verify_k_tokens_equals_k_decode_steps(model, k):
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 9, 13)]
    extra = [torch.randint(0, 256, (k,), generator=g).tolist() for _ in prompts]

    r1 = ModelRunner.create(model, num_pages=64, page_size=4)
    a = [Sequence.new(i, p) for i, p in enumerate(prompts)]
    r1.run(a)
    for s, e in zip(a, extra):
        s.token_ids.extend(e)
    verify = r1.run(a, logits="all").logits.view(len(a), k, -1)  # k new tokens per sequence at once

    r2 = ModelRunner.create(model, num_pages=64, page_size=4)
    b = [Sequence.new(i, p) for i, p in enumerate(prompts)]
    r2.run(b)
    steps = []
    for j in range(k):
        for s, e in zip(b, extra):
            s.token_ids.append(e[j])
        steps.append(r2.run(b).logits)
    torch.testing.assert_close(verify, torch.stack(steps, 1), rtol=1e-4, atol=1e-4)


def test_rows_of_mixed_lengths_over_a_cached_prefix_change_no_sequence(model):
    """Sequences with different numbers of new rows in one step (`StepRows`); rows run again over the same cached
    prefix take the place of rejected ones, with nothing to roll back; `forward` changes no sequence."""
    runner = ModelRunner.create(model, num_pages=32, page_size=2)
    s1, s2 = Sequence.new(0, [1, 2, 3, 4, 5]), Sequence.new(1, [7, 8])
    runner.run([s1, s2])  # the prompts cached, by hand
    for s in (s1, s2):
        runner.kv.ensure(s.pages, len(s) + 3)
    before = [(list(s.token_ids), s.num_cached, list(s.pages)) for s in (s1, s2)]
    out = runner.forward(StepRows([[9, 10, 11], [12]], [5, 2], [s1.pages, s2.pages]), logits="all")
    assert [(list(s.token_ids), s.num_cached, list(s.pages)) for s in (s1, s2)] == before
    torch.testing.assert_close(out.logits[2], _full_logits(model, [1, 2, 3, 4, 5, 9, 10, 11]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logits[3], _full_logits(model, [7, 8, 12]), rtol=1e-4, atol=1e-4)
    # 9 kept, 10 and 11 rejected: the next rows start after 9, over the slots they wrote
    out = runner.forward(StepRows([[42]], [6], [s1.pages]))
    torch.testing.assert_close(out.logits[0], _full_logits(model, [1, 2, 3, 4, 5, 9, 42]), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="needs 5 pages"):  # the pages must hold the rows
        runner.forward(StepRows([[1, 2, 3]], [7], [s1.pages[:4]]))
    runner.free(s1)
    runner.free(s2)
    assert runner.kv.allocator.num_free == 32


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("batch", ["one", "uniform", "mixed"])
def test_tree_step_equals_each_branch_as_a_chain(model, native, batch):
    """A tree step (a chain plus siblings of its first token) gives every row the logits of its own branch run as a
    plain chain from scratch — through the native kernel and through SDPA's masks, for one sequence, two of equal
    row counts and two of different ones."""
    from mtp_train.layers import cpu_kernels

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 14)]
    # new rows per sequence: [last, chain..., siblings of the first draft...], as tree.layout lays them
    shapes = {"one": [(2, 3)], "uniform": [(2, 3), (2, 3)], "mixed": [(3, 2), (1, 4)]}[batch]
    runner = ModelRunner.create(model, num_pages=64, page_size=4)
    seqs = [Sequence.new(i, p) for i, p in enumerate(prompts[: len(shapes)])]
    runner.run(seqs)
    rows, trees, branches = [], [], []
    for s, (d, a) in zip(seqs, shapes):
        new = torch.randint(0, 256, (1 + d + a,), generator=g).tolist()
        base = list(s.token_ids[:-1])
        s.token_ids[-1:] = new[:1]
        s.token_ids.extend(new[1:])
        rows_of = layout([DraftTree.chain(new[1:1 + d], siblings=new[1 + d:])], new[:1], [len(base) + 1])
        assert rows_of.tokens == [new]
        trees.append(rows_of.parents[0])  # -1, then the chain, then the siblings as children of the last token
        # the tokens each row's branch holds, from the start of the sequence
        branches.append([base + new[: i + 1] for i in range(1 + d)] + [base + [new[0], t] for t in new[1 + d:]])
        rows.append(1 + d + a)
        s.num_cached = len(base)
    with cpu_kernels.disabled() if not native else _nothing():
        out = runner.run(seqs, logits="all", tree=trees)
    for b, logits in enumerate(out.logits.split(rows)):
        for i, toks in enumerate(branches[b]):
            torch.testing.assert_close(logits[i], _full_logits(model, toks), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, b=b, i=i: f"sequence {b} row {i}: {m}")


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_tree_parents_are_checked():
    from mtp_train.layers import AttentionMetadata

    meta = AttentionMetadata.build([4], [10], [[0, 1, 2]], 4)
    meta.set_tree([[-1, 0, 1, 0]])
    assert meta.rope_positions.tolist() == [6, 7, 8, 7]  # depths 0 1 2 1 after 6 cached tokens
    assert meta.tree_bits.tolist() == [0b1, 0b11, 0b111, 0b1001]
    forest = AttentionMetadata.build([3], [10], [[0, 1, 2]], 4)
    forest.set_tree([[-1, -1, 1]])  # several roots over the prefix (a head's level of draft rows)
    assert forest.tree_bits.tolist() == [0b1, 0b10, 0b110] and forest.rope_positions.tolist() == [7, 7, 8]
    for bad in ([[-1, 0, 2, 0]], [[0, 0, 1, 0]], [[-1, 1, 1, 0]], [[-1, 0, 1]]):
        with pytest.raises(ValueError):
            AttentionMetadata.build([4], [10], [[0, 1, 2]], 4).set_tree(bad)
