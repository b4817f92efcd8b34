"""Answering turn by turn (`mtp_train.engine.turns`): what ends an answer, the answer's text, and the loop that
regeneration and evaluation share, driven by a scripted `generate` with SmolLM2's tokenizer and chat template."""

from __future__ import annotations

import pytest

from mtp_train.data.chat import ChatTemplateError, render
from mtp_train.engine.llm import GenerationOutput
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import (
    Dialogue,
    DialogueWindow,
    answer_text,
    answer_turns,
    end_of_turn_token_id,
    stop_token_ids,
)


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def test_end_of_turn_token_comes_from_the_template(tok):
    assert end_of_turn_token_id(tok) == tok.convert_tokens_to_ids("<|im_end|>") == 2
    # A template that closes turns with another special token: that token ends answers too.
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
    assert end_of_turn_token_id(tok) == 0 and stop_token_ids(tok, [2]) == [2, 0]
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}"  # no marker: EOS alone
    assert end_of_turn_token_id(tok) is None and stop_token_ids(tok, [2]) == [2]


def test_answer_text_drops_only_the_stop_token_it_ended_on(tok):
    body = tok("Hi <|im_start|> there ,  x", add_special_tokens=False)["input_ids"]
    assert 1 in body  # a special token inside the answer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    stopped = GenerationOutput([5], [*body, end], "stop")
    assert answer_text(tok, stopped) == "Hi <|im_start|> there ,  x"  # kept as generated, spaces untouched
    # Cut off by max_new_tokens: nothing is dropped, a special token at the end included.
    assert answer_text(tok, GenerationOutput([5], [*body, end], "length")) == "Hi <|im_start|> there ,  x<|im_end|>"
    # The text renders back to the tokens the model produced.
    text = render(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer_text(tok, stopped)}])
    assert tok(text, add_special_tokens=False)["input_ids"][-len(body) - 2:-1] == [*body, end]


class Scripted:
    """A `generate` that answers request i of call t with `replies[t][i]`, finishing in reverse order."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.calls = tok, replies, []

    def __call__(self, prompts, params, on_finish):
        self.calls.append((prompts, params))
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        outs = [GenerationOutput(p, [*self.tok(r, add_special_tokens=False)["input_ids"], end], "stop")
                for p, r in zip(prompts, self.replies[len(self.calls) - 1])]
        for i in reversed(range(len(outs))):
            on_finish(i, outs[i])


def test_each_turn_follows_the_models_own_answers(tok):
    dialogues = [Dialogue.of([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A?"},
                              {"role": "assistant", "content": "OLD"}, {"role": "user", "content": "B?"}], key=0),
                 Dialogue.of([{"role": "user", "content": "C?"}], key=1),
                 Dialogue.of([{"role": "assistant", "content": "no user"}], key=2)]
    gen = Scripted(tok, [["a1", "c1"], ["b1"]])
    done = []
    answer_turns(dialogues, gen, tok, SamplingParams(seed=4), on_done=lambda d: done.append(d.key))
    assert [d.answers for d in dialogues] == [["a1", "b1"], ["c1"], []]
    assert done == [1, 0] and dialogues[0].finish_reasons == ["stop", "stop"]
    assert dialogues[0].gen_tokens == [len(tok("a1", add_special_tokens=False)["input_ids"]) + 1] * 2
    assert dialogues[0].messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "A?"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "B?"},
        {"role": "assistant", "content": "b1"}]
    # The second prompt is the template's rendering of the first answer, with the generation prompt.
    second = render(tok, dialogues[0].messages()[:4], add_generation_prompt=True)
    assert gen.calls[1][0] == [tok(second, add_special_tokens=False)["input_ids"]]
    assert all(p.seed == 4 for _, p in gen.calls)  # one setting for all: passed through as it is


def test_hooks_drop_dialogues(tok):
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = ("{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('boom') }}"
                         "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    dialogues = [Dialogue.of([{"role": "user", "content": c} for c in ("x", "boom" if i == 3 else "y")], key=i)
                 for i in range(4)]
    gen = Scripted(tok, [["keep", " ", "keep", "keep"], ["end"]])
    errors = []
    answer_turns(dialogues, gen, tok, lambda d, t: SamplingParams(seed=10 * d.key + t),
                 admit=lambda d, ids: d.key != 2 or not d.answers,  # dialogue 2 is refused at its second turn
                 on_answer=lambda d, out, text: bool(text.strip()),  # dialogue 1 answers with whitespace
                 on_template_error=lambda d, exc: errors.append(d.key))  # dialogue 3's second turn fails
    assert [d.answers for d in dialogues] == [["keep", "end"], [], ["keep"], ["keep"]]
    assert errors == [3]
    assert [[p.seed for p in params] for _, params in gen.calls] == [[0, 10, 20, 30], [1]]
    # Without the hook the template's error propagates.
    with pytest.raises(ChatTemplateError, match="boom"):
        answer_turns([Dialogue.of([{"role": "user", "content": "boom"}])], gen, tok, SamplingParams())


def test_a_window_answers_like_answer_turns_and_reads_no_further_than_it_needs(tok):
    """`DialogueWindow` over a stream, answered in reverse order of asking: the answers of `answer_turns`, whatever
    the window's size; the stream is read as dialogues end."""

    def reply(prompt: list[int]) -> GenerationOutput:
        # an answer that depends on the prompt alone: its length, written out, and the stop token
        return GenerationOutput(prompt, tok(f"n{len(prompt)}", add_special_tokens=False)["input_ids"] + [2], "stop")

    def make() -> list[Dialogue]:
        return [Dialogue.of([{"role": "user", "content": f"q{i}"}] * (1 + i % 3), key=i) for i in range(7)]

    want = make()
    answer_turns(want, lambda prompts, params, on_finish: [on_finish(i, reply(p)) for i, p in enumerate(prompts)],
                 tok, lambda d, t: SamplingParams(seed=t))
    for size in (1, 3, 7):
        taken = []

        def stream(dialogues, taken=taken):
            for d in dialogues:
                taken.append(d.key)
                yield d

        done = []
        window = DialogueWindow(stream(make()), size, tok, lambda d, t: SamplingParams(seed=100 * d.key + t),
                                on_done=done.append, name=lambda d, t: f"conversation {d.key} turn {t + 1}")
        while (requests := window.feed()) is not None:
            assert requests and window.active <= size and len(taken) - len(done) <= size
            for r in reversed(requests):
                assert r.params.seed == 100 * r.key.key + len(r.key.answers)
                assert r.name == f"conversation {r.key.key} turn {len(r.key.answers) + 1}"
                window.answered(r, reply(r.prompt))
        assert sorted(d.key for d in done) == list(range(7)) and window.read == 7
        assert {d.key: d.answers for d in done} == {d.key: d.answers for d in want}, size
