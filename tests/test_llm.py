"""Batched generation with continuous batching."""

from __future__ import annotations

import pytest
import torch

from mtp_train.engine import LLMEngine, OutOfPagesError, SamplingParams
from mtp_train.models import load_model


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen2"][0], dtype="float32", backend="torch")


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_continuous_batching_equals_one_at_a_time(model):
    prompts = _prompts(7)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    # a small batch limit and a small pool force admissions while others are still decoding
    eng = LLMEngine(model, num_pages=24, page_size=4, max_batch_size=3)
    batched = eng.generate(prompts, params)
    assert eng.stats.prefill_steps > 2 and eng.stats.decode_steps > 0
    for p, out in zip(prompts, batched):
        single = LLMEngine(model, num_pages=16, page_size=4).generate([p], params)[0]
        assert out.output_ids == single.output_ids
        assert out.prompt_ids == p and len(out.output_ids) == 12 and out.finish_reason == "length"
    assert eng.runner.kv.allocator.num_free == 24  # every page returned


def test_stop_token_ends_a_request(model):
    prompt = _prompts(1, seed=3)[0]
    free = LLMEngine(model, num_pages=16).generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    stop = free.output_ids[4]
    first = free.output_ids.index(stop)
    out = LLMEngine(model, num_pages=16).generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=[stop]))
    assert out[0].output_ids == free.output_ids[: first + 1]
    assert out[0].finish_reason == "stop"


def test_seeded_sampling_does_not_depend_on_batch(model):
    prompts = _prompts(4, seed=5)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_new_tokens=8, ignore_eos=True, seed=7)
    a = LLMEngine(model, num_pages=64).generate(prompts, params)
    b = LLMEngine(model, num_pages=64, max_batch_size=1).generate(prompts, params)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    c = LLMEngine(model, num_pages=64).generate(prompts, SamplingParams(**{**vars(params), "seed": 8}))
    assert [o.output_ids for o in a] != [o.output_ids for o in c]


def test_request_larger_than_pool_is_refused(model):
    eng = LLMEngine(model, num_pages=2, page_size=4)
    with pytest.raises(OutOfPagesError, match="needs 5 pages"):
        eng.add_request(list(range(10)), SamplingParams(max_new_tokens=10))


def test_on_finish_streams_results(model):
    seen = {}
    outs = LLMEngine(model, num_pages=32).generate(_prompts(3), SamplingParams(max_new_tokens=3, ignore_eos=True),
                                                   on_finish=lambda i, o: seen.setdefault(i, o))
    assert [seen[i] for i in range(3)] == outs


def test_stream_takes_requests_as_they_are_fed_and_answers_as_generate_does(model):
    prompts = _prompts(9, seed=2)
    params = [SamplingParams(temperature=0.9, max_new_tokens=5, ignore_eos=True, seed=100 + i) for i in range(9)]
    want = LLMEngine(model, num_pages=64).generate(prompts, params)
    eng = LLMEngine(model, num_pages=64, max_batch_size=2)
    queued, got, waiting = [0], {}, []

    def feed():
        # one request per call, a new one only once the previous ones are answered: a window of two
        waiting.append(len(eng.waiting))
        if queued[0] == len(prompts):
            return None
        if queued[0] - len(got) >= 2:
            return []
        queued[0] += 1
        return [(prompts[queued[0] - 1], params[queued[0] - 1], queued[0] - 1)]

    eng.stream(feed, lambda i, out: got.setdefault(i, out))
    assert [got[i].output_ids for i in range(9)] == [o.output_ids for o in want]
    assert max(waiting) <= 2 and not eng.has_unfinished()

    with pytest.raises(RuntimeError, match="no request while none was in flight"):
        eng.stream(lambda: [], lambda i, out: None)
    boom = iter([[(prompts[0], params[0], 0), (prompts[1], params[1], 1)]])

    def fail(i, out):
        raise KeyError(i)

    with pytest.raises(KeyError):  # a callback's error stops the run and leaves nothing queued
        eng.stream(lambda: next(boom, None), fail)
    assert not eng.has_unfinished() and eng.runner.kv.allocator.num_free == 64
