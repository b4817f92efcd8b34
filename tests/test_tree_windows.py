"""Draft trees on sliding-window targets: the window counts a tree token's position (the cached prefix, then its
depth), not the slot it is verified in. The tree mask against a brute-force one; the native CPU kernel against SDPA
on a windowed tree step; greedy speculative decoding with trees (random trees holding the greedy path, a head's
dynamic tree) equals plain greedy decoding on Mistral, Qwen2 / Qwen3 with windows and GPT-OSS, with prompts longer
than the window."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from mtp_train.config import HeadConfig
from mtp_train.engine import LLMEngine, SamplingParams
from mtp_train.head_types.chain import HeadProposer
from mtp_train.heads import build_head
from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.layers.attention.masks import causal_mask
from mtp_train.layers.attention.torch_backend import TorchBackend
from mtp_train.models import load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.tree_draft import TreeSpec
from tests.conftest import make_tiny_checkpoint
from tests.test_tree_engine import RandomTrees

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 4
PROMPTS = [list(range(10, 24)), [3, 17, 42, 9, 100, 7, 8], [250] * 2 + list(range(40, 50))]
NEW = 24
# name → (family in conftest.TINY_CONFIGS or gpt_oss, config overrides); each slides a window of 4 somewhere
TARGETS = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),  # every layer, the head's block too
    "qwen2-mixed": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}),
    "gpt_oss": ("gpt_oss", {}),  # sliding, full, sliding
}
MODES = [pytest.param(True, id="native"), pytest.param(False, id="sdpa")]


def _kernels(native: bool):
    if native and not cpu_kernels.available():
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    return contextlib.nullcontext() if native else cpu_kernels.disabled()


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    import transformers

    from tests._family import save_random

    root = tmp_path_factory.mktemp("windows")
    for name, (family, over) in TARGETS.items():
        if family == "gpt_oss":
            cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                            max_position_embeddings=128, tie_word_embeddings=False)
            save_random(cfg, root / name, lambda n, t: t.normal_(0, 1.0) if n.endswith("sinks") else None)
        else:
            make_tiny_checkpoint(family, root / name, **over)
    return {name: root / name for name in TARGETS}


def _reference_mask(parents: list[int], cached: int, window: int | None, kv_len: int) -> torch.Tensor:
    """(Q, kv_len) by definition: node i at depth d stands at position cached + d and sees the cached positions and
    its ancestors (itself included) standing within the window; slots beyond the step's nodes are never seen."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    mask = torch.zeros(len(parents), kv_len, dtype=torch.bool)
    for i in range(len(parents)):
        at = cached + depth[i]
        lo = -1 if window is None else at - window
        mask[i, :cached] = torch.arange(cached) > lo
        node = i
        while node >= 0:
            mask[i, cached + node] = cached + depth[node] > lo
            node = parents[node]
    return mask


def _random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(-1, i) if rng.random() < 0.2 else rng.randrange(0, i) for i in range(1, n)]


@pytest.mark.parametrize("window", [None, 1, 3, 7])
def test_tree_mask_counts_tree_positions(window):
    rng = random.Random(window or 0)
    trees = [_random_parents(rng, 12), _random_parents(rng, 12)]
    cached = [9, 20]
    meta = AttentionMetadata.build([12, 12], [c + 12 for c in cached], [list(range(8)), list(range(8, 16))], 4)
    meta.set_tree(trees)
    s = 32
    got = causal_mask(meta.positions.view(2, 12), s, window, meta.tree_bits.view(2, 12),
                      meta.rope_positions.view(2, 12))  # the batched layout (B, Q, S)
    for b in range(2):
        want = _reference_mask(trees[b], cached[b], window, s)
        assert torch.equal(got[b], want), b
        one = causal_mask(meta.positions[12 * b:12 * (b + 1)], cached[b] + 12, window,
                          meta.tree_bits[12 * b:12 * (b + 1)], meta.rope_positions[12 * b:12 * (b + 1)])
        assert torch.equal(one, want[:, :cached[b] + 12])


def test_native_tree_step_with_a_window_equals_sdpa():
    if not cpu_kernels.available():
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, ps = 4, 2, 16, 4
    trees = [[-1, 0, 1, 2, 0, 4, 5, 1, 7], [-1, -1, 1, 2, 0]]
    kv = [30, 13]
    meta = AttentionMetadata.build([9, 5], kv, [list(range(8)), list(range(8, 12))], ps)
    meta.set_tree(trees)
    cache = torch.randn(12, 2, ps, hkv, d, generator=gen)
    q, k, v = (torch.randn(14, h, d, generator=gen) for h in (hq, hkv, hkv))
    for window in (2, 5):
        outs = []
        for native in (True, False):
            backend = TorchBackend(hq, hkv, d, window)
            with contextlib.nullcontext() if native else cpu_kernels.disabled():
                step = AttentionMetadata.build([9, 5], kv, [list(range(8)), list(range(8, 12))], ps)
                step.set_tree(trees)
                backend.prepare(step)
                assert step.backend_state["native"] is native
                outs.append(backend.forward(q, k, v, cache.clone(), step))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def _greedy(model, prompts):
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    return [o.output_ids for o in LLMEngine(model, page_size=3, num_pages=256).generate(prompts, params)]


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("name", list(TARGETS))
def test_random_trees_on_window_targets_equal_plain_greedy(targets, name, native):
    """Trees whose greedy path runs through random siblings: accepted nodes verified in slots far from their
    positions, the target's cache afterwards as plain decoding leaves it (RandomTrees checks it every step)."""
    model = load_model(targets[name])
    assert any(w is not None for w in model.args.windows)
    with _kernels(native):
        ref = _greedy(model, PROMPTS)
        plain = [p + o for p, o in zip(PROMPTS, ref)]
        proposer = RandomTrees(model, plain, k=4, nodes=12, seed=3)
        eng = SpecEngine(model, proposer, 4, page_size=3, num_pages=256)
        out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.output_ids for o in out] == ref
    m = eng.stats.metrics
    assert proposer.checked > 10 and m.num_branch_accepted > 0


@pytest.mark.parametrize("name", list(TARGETS))
def test_head_trees_on_window_targets_equal_plain_greedy(targets, name):
    """A head's dynamic tree and its first-draft siblings (the head's block slides the window on Mistral and
    Qwen3, where every layer does) keep greedy output."""
    model = load_model(targets[name])
    torch.manual_seed(0)
    # the target's last layer as the head's block where it fits (GPT-OSS's is MoE with sinks: from scratch there)
    head = build_head(HeadConfig(type="mtp", init="scratch" if name == "gpt_oss" else "last_layer"), targets[name])
    ref = _greedy(model, PROMPTS)
    for proposer, k in ((HeadProposer(head, tree=TreeSpec(3, 3, 8)), 3), (HeadProposer(head, draft_width=3), 2)):
        eng = SpecEngine(model, proposer, k, page_size=3, num_pages=256)
        assert [o.output_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW,
                                                                            ignore_eos=True))] == ref
        assert eng.stats.metrics.num_branch_tokens > 0
