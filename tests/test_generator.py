"""The `Generator` interface through its engine implementation: answers, limits, counters and provenance as a
stage sees them, and regeneration reading nothing else of whoever generates."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from mtp_train.engine import LLMEngine, OutOfPagesError, SamplingParams
from mtp_train.engine.generator import EngineGenerator, Generator
from mtp_train.models import load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import NgramProposer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 17, 42], [5, 9, 11, 200, 7, 1, 8], [9, 8, 7, 6] * 5]


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_model(tiny_checkpoints["llama"][0], dtype="float32", backend="torch")


def _generator(engine: LLMEngine) -> Generator:
    return EngineGenerator(engine, name="tiny", path="/models/tiny", weights_fingerprint="abc123")


def _params(n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=8, stop_token_ids=[5], seed=100 + i, **kw) for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_batch_is_answered_in_prompt_order_as_the_engine_answers_it(model, temperature):
    gen = _generator(LLMEngine(model, num_pages=64, page_size=4))
    finished: dict[int, object] = {}
    out = gen.generate(PROMPTS, _params(3, temperature=temperature), on_finish=finished.__setitem__)
    ref = LLMEngine(model, num_pages=64, page_size=4).generate(PROMPTS, _params(3, temperature=temperature))
    assert [(o.output_ids, o.finish_reason) for o in out] == [(o.output_ids, o.finish_reason) for o in ref]
    assert sorted(finished) == [0, 1, 2] and [finished[i] for i in range(3)] == out
    assert all(o.finish_reason in ("stop", "length") for o in out)
    assert all(o.output_ids[-1] == 5 for o in out if o.finish_reason == "stop")  # the stop token included
    # a request's answer is its own: alone, or last in another batch, it is the same
    alone = gen.generate([PROMPTS[2]], _params(3, temperature=temperature)[2:])
    assert alone[0].output_ids == out[2].output_ids
    with pytest.raises(TypeError, match="one SamplingParams per request"):
        gen.generate(PROMPTS, SamplingParams())  # type: ignore[arg-type]


def test_counters_cover_what_was_asked_and_answered(model):
    gen = _generator(LLMEngine(model, num_pages=64, page_size=4))
    before = gen.stats()
    out = gen.generate(PROMPTS, _params(3))
    after = gen.stats()
    assert after.prompt_tokens - before.prompt_tokens == sum(map(len, PROMPTS))
    assert after.generated_tokens - before.generated_tokens == sum(len(o.output_ids) for o in out)
    assert gen.stats() == after  # a snapshot: reading it changes nothing


@pytest.mark.parametrize("speculative", [False, True])
def test_the_request_limit_is_the_longest_request_the_generator_takes(model, speculative):
    """At exactly `max_request_tokens` a request is answered, one token more is refused; a speculative engine's
    limit leaves room for its draft rows."""
    engine = (SpecEngine(model, NgramProposer(), 3, num_pages=4, page_size=4) if speculative else
              LLMEngine(model, num_pages=4, page_size=4))
    gen = _generator(engine)
    limits = gen.limits
    assert limits.max_context == model.args.max_position_embeddings
    assert limits.max_request_tokens == 16 - (4 if speculative else 0)
    prompt = PROMPTS[1]
    fits = SamplingParams(max_new_tokens=limits.max_request_tokens - len(prompt), ignore_eos=True)
    (out,) = gen.generate([prompt], [fits])
    assert len(out.output_ids) == fits.max_new_tokens and out.finish_reason == "length"
    with pytest.raises(OutOfPagesError):
        gen.generate([prompt], [SamplingParams(max_new_tokens=fits.max_new_tokens + 1)])


def test_provenance_is_plain_data_a_stage_can_record(model):
    gen = _generator(LLMEngine(model, num_pages=8, page_size=4))
    prov = gen.provenance()
    assert prov == {"name": "tiny", "path": "/models/tiny", "weights_fingerprint": "abc123"}
    assert json.loads(json.dumps(prov)) == prov
    prov["name"] = "changed"
    assert gen.provenance()["name"] == "tiny"  # the caller's copy


ENGINE_NAMES_REGENERATION_MAY_USE = {
    "mtp_train.engine.generator": {"Generator", "Request"},
    "mtp_train.engine.turns": {"Dialogue", "DialogueWindow", "Generate", "OnFinish", "answer_turns"},
    "mtp_train.engine.llm": {"GenerationOutput"},
    "mtp_train.engine.sampling": {"SamplingParams"},
}


def test_regeneration_talks_to_the_generator_alone():
    """`mtp_train/regenerate/` imports of the engine only the Generator interface and the turn loop's types, and
    reaches into no engine (no runner, scheduler, KV pool or model config)."""
    for path in sorted((ROOT / "mtp_train" / "regenerate").glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mtp_train.engine"):
                allowed = ENGINE_NAMES_REGENERATION_MAY_USE.get(node.module or "", set())
                names = {a.name for a in node.names}
                assert names <= allowed, f"{path.name} imports {sorted(names - allowed)} from {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("mtp_train.engine") for a in node.names), path.name
        for internal in (".runner", ".scheduler", ".kv", ".model.args", "engine.stats"):
            assert internal not in text, f"{path.name} reads {internal}"
