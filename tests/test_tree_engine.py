"""Draft trees through the engine on tiny models: greedy output equals plain greedy for every tree shape (dynamic,
static, the chain as a tree, 64 verify rows) on the native CPU kernel and on SDPA; the head's catch-up state after a
tree step is a recompute; random trees with random accepted paths leave the target's cache as plain decoding of
the accepted tokens does, with every pruned branch's pages back in the pool."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence as Seq

import pytest
import torch

from mtp_train.config import HeadConfig
from mtp_train.engine import LLMEngine, ModelRunner, SamplingParams, Sequence, prefill_hidden
from mtp_train.engine.kv_cache import KVCache
from mtp_train.head_types.chain import HeadProposer
from mtp_train.heads import build_head
from mtp_train.layers import AttentionMetadata, cpu_kernels
from mtp_train.models import load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import Proposer
from mtp_train.speculative.tree import ROOT, DraftTree
from mtp_train.speculative.tree_draft import TreeSpec

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[3, 17, 42], [5, 9, 11, 200, 7, 1, 8], list(range(20, 33)), [250] * 2 + list(range(40, 58))]
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
SHAPES = {
    "chain": TreeSpec.chain(3),
    "3x2x6": TreeSpec(3, 2, 6),
    "4x4x16": TreeSpec(4, 4, 16),
    "2x8x64": TreeSpec(2, 8, 64),  # 63 nodes: 64 verify rows, the visibility bits' full width
    "static": TreeSpec(choices=[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]),
}


def _greedy(model, prompts, n=20):
    out = LLMEngine(model, page_size=3, num_pages=256).generate(prompts, SamplingParams(max_new_tokens=n,
                                                                                          ignore_eos=True))
    return [o.output_ids for o in out]


def _head(tiny_checkpoints, name="llama"):
    torch.manual_seed(0)
    return build_head(HeadConfig(type="mtp", init="last_layer"), tiny_checkpoints[name][0])


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_trees_equal_plain_greedy(tiny_checkpoints, shape, native):
    if native and not cpu_kernels.available():
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    model = load_model(tiny_checkpoints["llama"][0])
    spec = SHAPES[shape]
    with contextlib.nullcontext() if native else cpu_kernels.disabled():
        ref = _greedy(model, PROMPTS)
        for catch_up in ("target", "own"):
            eng = SpecEngine(model, HeadProposer(_head(tiny_checkpoints), catch_up=catch_up, tree=spec), spec.steps,
                             page_size=3, num_pages=256)
            out = eng.generate(PROMPTS, GREEDY)
            assert [o.output_ids for o in out] == ref, catch_up
            m = eng.stats.metrics
            assert m.num_draft_tokens <= (spec.tokens - 1) * m.num_drafts
            assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages and eng.runner.kv.reserved == 0


def test_a_chain_as_a_tree_is_the_chain(tiny_checkpoints):
    """TreeSpec.chain(k) through the tree drafter drafts, accepts and emits exactly what the chain drafter does."""
    model = load_model(tiny_checkpoints["qwen3"][0])
    head = _head(tiny_checkpoints, "qwen3")
    runs = []
    for tree in (None, TreeSpec.chain(3)):
        eng = SpecEngine(model, HeadProposer(head, tree=tree), 3, page_size=3, num_pages=256)
        runs.append(([o.output_ids for o in eng.generate(PROMPTS, GREEDY)], eng.stats.metrics.as_dict()))
    assert runs[0] == runs[1]


def test_a_wider_tree_accepts_more_than_its_chain(tiny_checkpoints):
    model = load_model(tiny_checkpoints["llama"][0])
    head = _head(tiny_checkpoints)
    tau = {}
    for name in ("chain", "4x4x16"):
        spec = SHAPES[name]
        eng = SpecEngine(model, HeadProposer(head, tree=spec), spec.steps, page_size=3, num_pages=256)
        eng.generate(PROMPTS, GREEDY)
        tau[name] = eng.stats.metrics.mean_acceptance_length
    assert tau["4x4x16"] > tau["chain"]


def test_the_heads_state_after_a_tree_step_is_a_recompute(tiny_checkpoints):
    """After every tree step the head's kept feature ĥ_{L-1} is a cache-free prefill of the head over the target's
    hidden states of the whole accepted sequence: the catch-up overwrote the tree's rows along the path."""
    model = load_model(tiny_checkpoints["qwen3"][0])
    head = _head(tiny_checkpoints, "qwen3")
    proposer = HeadProposer(head, tree=TreeSpec(3, 3, 10))
    eng = SpecEngine(model, proposer, 3, page_size=3, num_pages=256)
    for p in PROMPTS:
        eng.add_request(p, GREEDY)
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for s in eng.running:
            ids = s.token_ids[:-1]
            with torch.no_grad():
                ref = head(prefill_hidden(model, [ids]).hidden, torch.tensor(s.token_ids[1:]),
                           AttentionMetadata.build([len(ids)]), from_target=True).hidden[-1]
            torch.testing.assert_close(proposer._feat[s.seq_id], ref, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked > 10 and eng.stats.metrics.num_branch_tokens > 0


def test_tree_options_are_checked(tiny_checkpoints):
    head = _head(tiny_checkpoints)
    with pytest.raises(ValueError, match="k=3"):
        SpecEngine(load_model(tiny_checkpoints["llama"][0]), HeadProposer(head, tree=TreeSpec(3, 2, 6)), 2,
                   num_pages=64)
    with pytest.raises(ValueError, match="not both"):
        HeadProposer(head, draft_width=2, tree=TreeSpec(2, 2, 4))
    with pytest.raises(ValueError, match="draft_threshold"):
        HeadProposer(head, draft_threshold=0.3, tree=TreeSpec(2, 2, 4))


class RandomTrees(Proposer):
    """Random trees of random shapes, each holding the plain greedy continuation along a random path (so greedy
    verification accepts a random path), and checks of the target's cache: before every step positions 0..L-2 hold
    the K/V a plain prefill of the accepted tokens gives, after every commit no page beyond them is held."""

    name = "random-trees"

    def __init__(self, model, plain: list[list[int]], k: int, nodes: int, seed: int) -> None:
        self.model, self.plain, self.k, self.nodes = model, plain, k, nodes
        self.rng = random.Random(seed)
        self.kv: KVCache | None = None
        self.checked = 0

    def max_nodes(self, k: int) -> int:
        return self.nodes

    @property
    def drafts_trees(self) -> bool:
        return True

    def bind(self, target_kv: KVCache) -> None:
        self.kv = target_kv

    def prefill(self, seqs: Seq[Sequence], target_hidden: torch.Tensor) -> None:
        pass

    def _truth(self, seq: Sequence) -> list[int]:
        full = next(p for p in self.plain if p[:len(seq)] == seq.token_ids)
        return full[len(seq):]

    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        trees = []
        for s in seqs:
            self._check_cache(s)
            truth = self._truth(s)
            n = self.rng.randint(1, self.nodes)
            parents = [ROOT]
            depth = [1]
            for i in range(1, n):
                p = self.rng.choice([ROOT] + [j for j in range(i) if depth[j] < k])
                parents.append(p)
                depth.append(depth[p] + 1 if p != ROOT else 1)
            tokens = [self.rng.randrange(self.model.args.vocab_size) for _ in range(n)]
            leaf = self.rng.randrange(n)
            node = leaf
            while node != ROOT:  # the path to a random node carries the target's tokens
                if depth[node] <= len(truth):
                    tokens[node] = truth[depth[node] - 1]
                node = parents[node]
            trees.append(DraftTree(tokens, parents))
        return trees

    def _check_cache(self, s: Sequence) -> None:
        assert self.kv is not None
        cached = len(s) - 1
        assert s.num_cached == cached
        ref = ModelRunner.create(self.model, num_pages=64, page_size=self.kv.page_size)
        seq = Sequence.new(0, list(s.token_ids[:-1]) + [0])
        ref.run([seq])
        ps = self.kv.page_size
        slots = torch.arange(cached)
        for mine, theirs in zip(self.kv.layers, ref.kv.layers):
            a = mine[torch.tensor(s.pages)[slots // ps], :, slots % ps]
            b = theirs[torch.tensor(seq.pages)[slots // ps], :, slots % ps]
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        self.checked += 1

    def update(self, seqs, old_lens, trees, paths, target_hidden) -> None:
        assert self.kv is not None
        for s, n, path in zip(seqs, old_lens, paths):  # after postprocess: t_{L-1} and the path cached, the bonus not
            assert s.num_cached == n + len(path) == len(s) - 1

    def release(self, seq: Sequence) -> None:
        pass


@pytest.mark.parametrize("native", [True, False])
def test_random_trees_commit_the_accepted_path_as_plain_decoding_does(tiny_checkpoints, native):
    if native and not cpu_kernels.available():
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    model = load_model(tiny_checkpoints["llama"][0])
    with contextlib.nullcontext() if native else cpu_kernels.disabled():
        ref = _greedy(model, PROMPTS, n=30)
        plain = [p + o for p, o in zip(PROMPTS, ref)]
        proposer = RandomTrees(model, plain, k=4, nodes=12, seed=int(native))
        eng = SpecEngine(model, proposer, 4, page_size=3, num_pages=256)
        out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert [o.output_ids for o in out] == ref
    m = eng.stats.metrics
    assert proposer.checked > 20 and m.num_branch_accepted > 0 and m.num_accepted > m.num_drafts // 2
    assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages
