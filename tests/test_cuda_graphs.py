"""CUDA-graph steps: buckets, padding onto the scratch page, output slicing, and the engines that use them.

On CPU the padded fixed-shape steps run eagerly (`capture=False`, the torch backend): greedy output through them
must equal plain greedy output, for plain decoding and for speculative decoding (verify and draft steps). With
CUDA and FlashInfer the same checks run with captured graphs.
"""

from __future__ import annotations

import pytest
import torch

from mtp_train.config import HeadConfig
from mtp_train.engine import LLMEngine, SamplingParams
from mtp_train.engine.cuda_graphs import StepGraphs, batch_buckets
from mtp_train.head_types.chain import HeadProposer
from mtp_train.heads import build_head
from mtp_train.models import load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import NgramProposer
from tests._gpu import needs_flashinfer

pytestmark = pytest.mark.usefixtures("one_thread")

# 1, 3 and 5 sequences: buckets 1, 4 (one padded row) and 8 (three); lengths cross page boundaries
PROMPTS = [[3, 17, 42], [5, 9, 11, 200, 7, 1, 8], list(range(20, 33)), [250] * 2 + list(range(40, 58)), [9] * 5]
PARAMS = SamplingParams(max_new_tokens=14, ignore_eos=True)


def _outputs(engine, prompts) -> list[list[int]]:
    return [o.output_ids for o in engine.generate(prompts, PARAMS)]


def _head(path, kind="mtp"):
    torch.manual_seed(0)
    cfg = HeadConfig(type=kind, init="last_layer") if kind == "mtp" else HeadConfig(type=kind, draft_vocab_size=96)
    return build_head(cfg, path)


def test_buckets_are_vllms_capture_sizes():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_padded_decode_steps_equal_plain_greedy(tiny_checkpoints, batch):
    model = load_model(tiny_checkpoints["llama"][0])
    prompts = PROMPTS[:batch]
    ref = _outputs(LLMEngine(model, page_size=3, num_pages=128, cuda_graphs=False), prompts)
    eng = LLMEngine(model, page_size=3, num_pages=128, max_batch_size=8, cuda_graphs=True)
    graphs = eng.runner.graphs[(1, ())]
    assert _outputs(eng, prompts) == ref
    # every decode step went through the padded path; the prefill did not
    assert graphs.replays == eng.stats.decode_steps > 0
    kv = eng.runner.kv
    assert len(eng.runner.scratch_pages) == 1
    assert kv.allocator.num_free == kv.num_pages - 1  # every page but the scratch page came back


def test_padded_rows_never_touch_a_sequences_pages(tiny_checkpoints):
    """A padded step writes the real rows' K/V exactly where an eager step does and nothing else outside the
    scratch page."""
    model = load_model(tiny_checkpoints["llama"][0])
    eng = LLMEngine(model, page_size=3, num_pages=64, max_batch_size=8, cuda_graphs=True)
    plain = LLMEngine(model, page_size=3, num_pages=64, cuda_graphs=False)
    out_g = eng.generate(PROMPTS[:3], PARAMS)
    out_p = plain.generate(PROMPTS[:3], PARAMS)
    assert [o.output_ids for o in out_g] == [o.output_ids for o in out_p]
    scratch = eng.runner.scratch_pages[0]
    pool = eng.runner.kv.pool
    # the scratch page holds the padded rows' K/V (token 0 at positions 0..q-1), so it is no longer zero
    assert pool[:, scratch].abs().sum() > 0


def test_step_graphs_refuse_what_they_cannot_run(tiny_checkpoints):
    model = load_model(tiny_checkpoints["llama"][0])
    eng = LLMEngine(model, page_size=3, num_pages=32, cuda_graphs=False)
    kv = eng.runner.kv

    def fn(ids, hidden, meta):
        return (ids,)

    with pytest.raises(ValueError, match="CUDA device"):
        StepGraphs(fn, model.attn, kv, [0], q=1, max_batch=4, capture=True, device="cpu")
    with pytest.raises(ValueError, match="need 2 scratch pages at page size 3"):
        StepGraphs(fn, model.attn, kv, [0], q=4, max_batch=4, capture=False)
    graphs = StepGraphs(fn, model.attn, kv, [0], q=1, max_batch=4, capture=False)
    with pytest.raises(ValueError, match="largest captured batch 4"):
        graphs.bucket_for(5)
    with pytest.raises(ValueError, match="2 tokens for 1 sequences"):
        graphs.run([1, 2], [3], [[1]])
    with pytest.raises(ValueError, match="hidden must be given"):
        graphs.run([1], [3], [[1]], hidden=torch.zeros(1, 4))


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
@pytest.mark.parametrize("k", [1, 3])
def test_padded_verify_and_draft_steps_equal_plain_greedy(tiny_checkpoints, kind, k):
    path = tiny_checkpoints["llama"][0]
    model = load_model(path)
    ref = _outputs(LLMEngine(model, page_size=3, num_pages=256, cuda_graphs=False), PROMPTS)
    proposer = HeadProposer(_head(path, kind))
    eng = SpecEngine(model, proposer, k, page_size=3, num_pages=256, max_batch_size=8, cuda_graphs=True)
    assert _outputs(eng, PROMPTS) == ref
    verify = eng.runner.graphs[(k + 1, proposer.hidden_layers)]
    assert verify.replays == eng.stats.verify_steps > 0  # fixed k: every verify step is a fixed-shape step
    assert proposer.graphs is not None
    assert proposer.graphs.replays == (k - 1) * eng.stats.verify_steps  # k-1 chained draft steps per step
    kv = eng.runner.kv
    assert kv.allocator.num_free == kv.num_pages - len(eng.runner.scratch_pages) == kv.num_pages - kv.pages_for(k + 1)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
@pytest.mark.parametrize("k", [1, 3])
def test_padded_catch_up_over_the_verify_rows_equals_plain_greedy(tiny_checkpoints, kind, k):
    """The head's catch-up takes the verify's fixed shape (k + 1 rows a sequence, padded to the bucket): one
    replay per verify step, the same output as plain greedy, and the head's kept ĥ the same as the eager
    engine's; catch_up=own (a separate pass of varying rows) has no such step."""
    path = tiny_checkpoints["llama"][0]
    model = load_model(path)
    ref = _outputs(LLMEngine(model, page_size=3, num_pages=256, cuda_graphs=False), PROMPTS)
    proposer = HeadProposer(_head(path, kind))
    eng = SpecEngine(model, proposer, k, page_size=3, num_pages=256, max_batch_size=8, cuda_graphs=True)
    eager_prop = HeadProposer(_head(path, kind))
    eager = SpecEngine(model, eager_prop, k, page_size=3, num_pages=256, max_batch_size=8, cuda_graphs=False)
    seqs = [eng.add_request(p, PARAMS) for p in PROMPTS]
    for p in PROMPTS:
        eager.add_request(p, PARAMS)
    checked = 0
    while eng.has_unfinished():
        eng.step()
        eager.step()
        for s, t in zip(eng.running, eager.running):
            assert s.token_ids == t.token_ids
            torch.testing.assert_close(proposer._feat[s.seq_id], eager_prop._feat[t.seq_id], rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked > 0 and not eager.has_unfinished()
    assert [s.output_ids for s in seqs] == ref
    assert proposer.verify_graphs is not None
    assert proposer.verify_graphs.replays == eng.stats.verify_steps > 0
    own = HeadProposer(_head(path, kind), catch_up="own")
    SpecEngine(model, own, k, page_size=3, num_pages=64, max_batch_size=2, cuda_graphs=True)
    assert own.graphs is not None and own.verify_graphs is None


def test_steps_of_mixed_draft_lengths_run_eagerly(tiny_checkpoints):
    """Prompt lookup drafts 0..k tokens per sequence: only the steps where all drafted k go through the graphs."""
    model = load_model(tiny_checkpoints["llama"][0])
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4], [8] * 9]
    ref = _outputs(LLMEngine(model, page_size=3, num_pages=256, cuda_graphs=False), prompts)
    eng = SpecEngine(model, NgramProposer(), 2, page_size=3, num_pages=256, max_batch_size=4, cuda_graphs=True)
    assert _outputs(eng, prompts) == ref
    assert eng.runner.graphs[(3, ())].replays <= eng.stats.verify_steps


@needs_flashinfer()
def test_captured_graphs_equal_eager_on_cuda(tiny_checkpoints):
    path = tiny_checkpoints["llama"][0]
    model = load_model(path, device="cuda", dtype=torch.bfloat16, attention_backend="flashinfer")
    ref = _outputs(LLMEngine(model, page_size=4, num_pages=256, cuda_graphs=False), PROMPTS)
    eng = LLMEngine(model, page_size=4, num_pages=256, max_batch_size=8, cuda_graphs=True)
    assert _outputs(eng, PROMPTS) == ref
    graphs = eng.runner.graphs[(1, ())]
    assert graphs.capture and 1 <= graphs.captures <= len(graphs.buckets)
    head = _head(path).to("cuda", torch.bfloat16)
    proposer = HeadProposer(head)
    spec = SpecEngine(model, proposer, 3, page_size=4, num_pages=256, max_batch_size=8, cuda_graphs=True)
    assert _outputs(spec, PROMPTS) == ref
    assert proposer.graphs is not None and proposer.graphs.captures >= 1
