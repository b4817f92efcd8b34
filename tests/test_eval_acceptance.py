"""`evaluate`'s schedule on a tiny chat target: the baseline and every method answer the same chunks of
conversations in turn, from one shared page pool, and the chunk pairs give the speed-up's interval."""

from __future__ import annotations

import pytest

from mtp_train.config import EvalConfig
from mtp_train.data.chat import load_tokenizer
from mtp_train.data.prompts import PromptSet
from mtp_train.data.readers import Conversation
from mtp_train.engine import LLMEngine, SamplingParams
from mtp_train.engine.runner import kv_pool
from mtp_train.eval import acceptance
from mtp_train.eval.acceptance import evaluate
from mtp_train.eval.methods import MethodSet
from mtp_train.eval.options import EvalPoint, expand_grid
from mtp_train.eval.rows import overall_rows, result_row
from mtp_train.models import load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import NgramProposer
from tests.conftest import TOPICS, make_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_chat_target(tmp_path_factory.mktemp("chat") / "target")
    return load_model(path, dtype="float32", device="cpu"), load_tokenizer(path)


def _prompts(n: int) -> PromptSet:
    convs = [Conversation(f"c{i}", [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}],
                          "test", i + 1) for i in range(n)]
    return PromptSet("tiny", convs)


def test_every_engine_answers_every_chunk_in_turn_and_greedy_answers_agree(target, monkeypatch):
    model, tok = target
    order: list[tuple[str, int]] = []  # (engine kind and k, first conversation id) as the chunks ran
    real = acceptance.answer

    def spy(engine, tokenizer, convs, params, template_kwargs=None, progress=False):
        order.append((f"{type(engine).__name__}{getattr(engine, 'k', '')}", convs[0].id))
        return real(engine, tokenizer, convs, params, template_kwargs, progress)

    monkeypatch.setattr(acceptance, "answer", spy)
    cfg = EvalConfig(method="ngram", k=[1, 2], max_new_tokens=12, batch_size=2, repeats=2, warmup=False,
                     progress=False)
    pairs, (base,) = evaluate(model, tok, [_prompts(5)], expand_grid(cfg), MethodSet(cfg), cfg, stop_ids=None)
    engines = ["LLMEngine", "SpecEngine1", "SpecEngine2"]
    # 3 chunks (2 + 2 + 1 conversations) × 2 repeats, each answered by all three engines one after another, the
    # first engine rotating from chunk to chunk, so none always runs first (or last).
    starts = ["c0", "c2", "c4"] * 2
    assert [c for _, c in order] == [s for s in starts for _ in engines]
    firsts = [order[3 * i][0] for i in range(6)]
    assert firsts == [engines[i % 3] for i in range(6)]
    for run in [base] + [r for r, _ in pairs]:
        assert len(run.answers) == 5  # the first repeat's answers, one per conversation
        assert len(run.chunks) == 6 and sum(t for t, _ in run.chunks) == run.generated_tokens
        assert run.seconds == pytest.approx(sum(s for _, s in run.chunks))
    for run, b in pairs:
        assert [[o.output_ids for o in c] for c in run.answers] == [[o.output_ids for o in c] for c in b.answers]
        assert [t for t, _ in run.chunks] == [t for t, _ in b.chunks]  # the same tokens, chunk by chunk
        assert run.metrics is not None and run.metrics.num_drafts > 0
        row = result_row(run, b)
        assert row["exact_match"] == 1.0
        assert row["speedup_lo"] <= row["speedup_hi"] and row["speedup_lo"] > 0
    over = overall_rows(pairs)
    assert {r["k"] for r in over} == {1, 2} and all("speedup_lo" in r for r in over)
    assert [r["label"] for r in over] == ["prompt lookup k=1", "prompt lookup k=2"]


def test_every_temperature_of_the_grid_needs_its_plain_baseline(target):
    model, tok = target
    cfg = EvalConfig(method="ngram", k=1, temperature=[0, 1], max_new_tokens=4, warmup=False, progress=False)
    points = [p for p in expand_grid(cfg) if not (p.method == "none" and p.temperature == 1)]
    with pytest.raises(ValueError, match="one plain baseline at temperature 1"):
        evaluate(model, tok, [_prompts(1)], points, MethodSet(cfg), cfg, stop_ids=None)
    assert EvalPoint("none", temperature=1.0) in expand_grid(cfg)


def test_engines_sharing_a_pool_admit_against_one_count(target):
    """Two engines on one pool: what one reserves the other cannot promise again, and every page comes back."""
    model, _ = target
    kv = kv_pool(model, num_pages=12, page_size=4)
    plain = LLMEngine(model, kv=kv, max_batch_size=4)
    spec = SpecEngine(model, NgramProposer(), 2, kv=kv, max_batch_size=4)
    assert plain.runner.kv is kv and spec.runner.kv is kv
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    a = plain.generate(prompts, params)
    b = spec.generate(prompts, params)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert kv.reserved == 0 and kv.allocator.num_free == kv.num_pages
    # A request that holds most of the pool leaves the other engine too little to admit its own.
    big = plain.add_request(list(range(1, 30)), SamplingParams(max_new_tokens=10, ignore_eos=True))
    plain.step()  # admitted: its pages are now reserved in the shared pool
    assert kv.reserved == kv.pages_for(plain.reserve_tokens(big))
    spec.add_request(list(range(1, 20)), params)
    assert spec.step() == [] and not spec.running  # not admitted: the pool is promised to the other engine
    while plain.has_unfinished():
        plain.step()
    while spec.has_unfinished():
        spec.step()
    assert kv.reserved == 0 and kv.allocator.num_free == kv.num_pages


def test_repeats_and_batch_size_are_checked():
    from mtp_train.config.errors import ConfigError

    with pytest.raises(ConfigError, match="repeats"):
        EvalConfig(repeats=0)
