"""Answering conversations turn by turn: each user turn after the model's own earlier answers.

A conversation's assistant turns are dropped and its user turns answered one at a time: answer 1 is generated
for [system?, user 1], answer 2 for [system?, user 1, answer 1, user 2], and so on. Turn t of every dialogue still
answering goes through one `generate` call (continuous batching), then turn t+1 for those that have one.
Evaluation (`mtp_train.eval`) answers through `answer_turns`; `answer` is that loop over an engine, for evaluation
and the training run's speculative validation. Self-distillation (`mtp_train.regenerate`) reads data sets too large
to hold and answers through `DialogueWindow`, the same loop over a stream: at most `size` dialogues at a time, each
one's turn t+1 asked as soon as its answer t is in, the window refilled from the stream as dialogues end. Both render
and answer a dialogue alike (the same prompts, the same per-request params), so the second prompt of a conversation
is the same in both.

The special-token rule, one for every stage:

* Prompt: the tokenizer's chat template with the generation prompt, tokenized without extra special tokens (the
  template writes its own BOS and role markers).
* Stop: an answer ends on the model's EOS ids, the tokenizer's EOS and the template's end-of-turn token
  (`stop_token_ids`; the engine includes the token it stopped on in `output_ids`).
* Text: an answer that ended on a stop token (finish reason "stop") loses that one last token, which belongs to
  the template (it writes it again when the answer is rendered as history); every other token is decoded as
  generated, special tokens included and without clean-up of spaces (`answer_text`). The text then renders and
  tokenizes back to what the model produced, and the next turn's prompt, and a stored conversation, carry the
  answer as the model wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtp_train.data.chat import ChatTemplateError, render
from mtp_train.data.readers import Conversation
from mtp_train.engine.generator import Request
from mtp_train.engine.llm import GenerationOutput, LLMEngine
from mtp_train.engine.sampling import SamplingParams

OnFinish = Callable[[int, GenerationOutput], None]
# generate(prompts, params, on_finish): one turn's requests (token ids); on_finish(i, output) as request i completes.
Generate = Callable[[list[list[int]], SamplingParams | list[SamplingParams], OnFinish], Any]


def end_of_turn_token_id(tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> int | None:
    """The special token the chat template writes right after an assistant turn's content, or None.

    Found from a rendering rather than a list of marker names: the text after a probe answer is the turn's
    closing (`<|im_end|>\\n`, `<|eot_id|>`, `<|end|>\\n`, ...), and its first special token ends the turn.
    """
    probe = "\ue000"
    try:
        text = render(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}],
                      template_kwargs=template_kwargs)
    except ChatTemplateError:
        return None
    at = text.rfind(probe)
    if at < 0:
        return None
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    for tid in tokenizer(text[at + len(probe):], add_special_tokens=False)["input_ids"]:
        if tid in special:
            return int(tid)
    return None


def stop_token_ids(tokenizer: Any, model_eos_ids: Sequence[int],
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """What ends an answer: the model's EOS ids, the tokenizer's EOS and the template's end-of-turn token."""
    ids = [int(i) for i in model_eos_ids]
    for extra in (getattr(tokenizer, "eos_token_id", None), end_of_turn_token_id(tokenizer, template_kwargs)):
        if extra is not None and int(extra) not in ids:
            ids.append(int(extra))
    if not ids:
        raise ValueError("no stop token: the model declares no eos_token_id and the tokenizer and chat template "
                         "name none; answers would always run to max_new_tokens")
    return ids


def prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
               template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The prompt of one request (the module's rule): `messages` rendered by the chat template with the generation
    prompt, tokenized without extra special tokens. What a server answering chat requests feeds the model, and
    what its prompt token ids are compared with."""
    text = render(tokenizer, [dict(m) for m in messages], add_generation_prompt=True, template_kwargs=template_kwargs)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def answer_text(tokenizer: Any, output: GenerationOutput) -> str:
    """The text of one answer (the module's rule): without the stop token it ended on, everything else as
    generated (special tokens kept, spaces not cleaned up)."""
    ids = output.output_ids
    if output.finish_reason == "stop" and ids:
        ids = ids[:-1]  # the stop token the engine finished on: the template's, not the answer's
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class Dialogue:
    """One conversation answered turn by turn: its system messages, its user turns and the answers so far.

    `key` is whatever the caller needs to find its own record again (a position, a sample index, ...).
    """

    system: list[dict[str, str]]
    users: list[str]
    key: Any = None
    answers: list[str] = field(default_factory=list)  # answer texts (`answer_text`), one per answered user turn
    finish_reasons: list[str] = field(default_factory=list)  # "stop" | "length", per answered turn
    gen_tokens: list[int] = field(default_factory=list)  # tokens generated per answered turn (the stop included)

    @classmethod
    def of(cls, messages: Sequence[Mapping[str, str]], key: Any = None) -> Dialogue:
        """The system messages and user contents of `messages`; its assistant turns are dropped."""
        system = [dict(m) for m in messages if m["role"] == "system"]
        return cls(system, [m["content"] for m in messages if m["role"] == "user"], key)

    @property
    def done(self) -> bool:
        return len(self.answers) == len(self.users)

    def messages(self) -> list[dict[str, str]]:
        """[system?, user 1, answer 1, user 2, ...] as far as answered (unanswered user turns included)."""
        msgs = list(self.system)
        for t, user in enumerate(self.users):
            msgs.append({"role": "user", "content": user})
            if t < len(self.answers):
                msgs.append({"role": "assistant", "content": self.answers[t]})
        return msgs

    def prompt_messages(self) -> list[dict[str, str]]:
        """[system?, user 1, answer 1, ..., user t] for the next turn t."""
        return self.messages()[: len(self.system) + 2 * len(self.answers) + 1]


def answer_turns(dialogues: Sequence[Dialogue], generate: Generate, tokenizer: Any,
                 params: SamplingParams | Callable[[Dialogue, int], SamplingParams], *,
                 template_kwargs: Mapping[str, Any] | None = None,
                 admit: Callable[[Dialogue, list[int]], bool] | None = None,
                 on_template_error: Callable[[Dialogue, ChatTemplateError], None] | None = None,
                 on_answer: Callable[[Dialogue, GenerationOutput, str], bool] | None = None,
                 on_done: Callable[[Dialogue], None] | None = None) -> None:
    """Answer every user turn of every dialogue, turn by turn, each turn after the model's own answers.

    params: one SamplingParams for every request of a turn (the engine seeds request i with seed + i), or
    params(dialogue, turn) per request. The hooks let a caller drop a dialogue: admit(dialogue, prompt_ids) before
    its turn is generated (False: not generated, no further turns); on_template_error(dialogue, error) when its
    prompt cannot be rendered (without it the error propagates); on_answer(dialogue, output, text) as each answer
    arrives (False: the answer is not kept and the dialogue stops). on_done(dialogue) runs as soon as its last
    turn is answered. Dialogues without a user turn are left alone.
    """
    active = [d for d in dialogues if not d.done]
    turn = 0
    while active:
        batch, prompts = _prompts(active, tokenizer, template_kwargs, admit, on_template_error)
        if not batch:
            break
        turn_params = params if isinstance(params, SamplingParams) else [params(d, turn) for d in batch]
        active = _generate_turn(batch, prompts, turn_params, generate, tokenizer, on_answer, on_done)
        turn += 1


class DialogueWindow:
    """Dialogues answered turn by turn, at most `size` at a time, taken from a stream as earlier ones end.

    The streaming form of `answer_turns`, for `Generator.stream(window.feed, window.answered)`: `feed` returns the
    next turn's request of every dialogue whose previous answer came in (rendered, tokenized and admitted as
    `answer_turns` does) and fills the window from `dialogues` as dialogues end; `answered` records an answer. Turn
    t+1 of a dialogue is asked once its answer t is in, so every prompt holds the model's own earlier answers. A
    request's params come from params(dialogue, turn) alone (a seed of its own), so a dialogue's answers do not
    depend on the window's size or on which dialogues it shared a batch with. Only the window's dialogues are held;
    the stream is read no further than the window needs (`read` counts what was taken).

    Args:
        dialogues: the dialogues, read lazily (a generator over a data set); those without a user turn are passed by.
        size: dialogues in flight at most (>= 1).
        tokenizer: renders and tokenizes the prompts (the module's rule).
        params: params(dialogue, turn) of each request, turn counted from 0.
        template_kwargs: the chat template's extra variables.
        admit, on_template_error, on_answer, on_done: the hooks of `answer_turns`, with the same meaning.
        name: name(dialogue, turn) of a request, for the generator's errors; None: the generator numbers them.
    """

    def __init__(self, dialogues: Iterable[Dialogue], size: int, tokenizer: Any,
                 params: Callable[[Dialogue, int], SamplingParams], *,
                 template_kwargs: Mapping[str, Any] | None = None,
                 admit: Callable[[Dialogue, list[int]], bool] | None = None,
                 on_template_error: Callable[[Dialogue, ChatTemplateError], None] | None = None,
                 on_answer: Callable[[Dialogue, GenerationOutput, str], bool] | None = None,
                 on_done: Callable[[Dialogue], None] | None = None,
                 name: Callable[[Dialogue, int], str] | None = None) -> None:
        if size < 1:
            raise ValueError(f"a window holds at least one dialogue, got size={size}")
        self.size, self.tokenizer, self.params, self.template_kwargs = size, tokenizer, params, template_kwargs
        self.admit, self.on_template_error, self.on_answer, self.on_done = admit, on_template_error, on_answer, on_done
        self.name = name
        self.read = 0  # dialogues taken from the stream so far
        self.active = 0  # dialogues in the window: a request in flight, or their next turn ready
        self._source = iter(dialogues)
        self._ready: list[Dialogue] = []  # dialogues whose next turn is to be asked, in the order they got ready
        self._exhausted = False

    def feed(self) -> list[Request] | None:
        """The requests ready now: the next turn of every dialogue answered since the last call, then the first turn
        of new dialogues while the window has room. [] when every dialogue in the window waits for an answer; None
        when the stream is read and every dialogue has ended."""
        requests: list[Request] = []
        while True:
            while self.active < self.size and not self._exhausted:
                d = next(self._source, None)
                if d is None:
                    self._exhausted = True
                    break
                self.read += 1
                if not d.done:
                    self.active += 1
                    self._ready.append(d)
            if not self._ready:
                break
            ready, self._ready = self._ready, []
            batch, prompts = _prompts(ready, self.tokenizer, self.template_kwargs, self.admit, self.on_template_error)
            self.active -= len(ready) - len(batch)  # refused dialogues leave room for the stream's next ones
            for d, ids in zip(batch, prompts):
                turn = len(d.answers)
                requests.append(Request(ids, self.params(d, turn), key=d,
                                        name=None if self.name is None else self.name(d, turn)))
        if not requests and not self.active and self._exhausted:
            return None
        return requests

    def answered(self, request: Request, out: GenerationOutput) -> None:
        """Record the answer to a request of `feed`: the dialogue's next turn becomes ready, or it ends."""
        d: Dialogue = request.key
        text = answer_text(self.tokenizer, out)
        if self.on_answer is not None and not self.on_answer(d, out, text):
            self.active -= 1
            return
        d.answers.append(text)
        d.finish_reasons.append(out.finish_reason)
        d.gen_tokens.append(len(out.output_ids))
        if not d.done:
            self._ready.append(d)
            return
        self.active -= 1
        if self.on_done is not None:
            self.on_done(d)


def _prompts(active: list[Dialogue], tokenizer: Any, template_kwargs: Mapping[str, Any] | None,
             admit: Callable[[Dialogue, list[int]], bool] | None,
             on_template_error: Callable[[Dialogue, ChatTemplateError], None] | None,
             ) -> tuple[list[Dialogue], list[list[int]]]:
    """The dialogues whose next prompt renders and is admitted, and those prompts (token ids)."""
    ready: list[Dialogue] = []
    texts: list[str] = []
    for d in active:
        try:
            texts.append(render(tokenizer, d.prompt_messages(), add_generation_prompt=True,
                                template_kwargs=template_kwargs))
            ready.append(d)
        except ChatTemplateError as exc:
            if on_template_error is None:
                raise
            on_template_error(d, exc)
    # One call for the whole turn: a fast tokenizer encodes the batch on all cores.
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    batch: list[Dialogue] = []
    prompts: list[list[int]] = []
    for d, ids in zip(ready, encoded):
        ids = list(ids)
        if admit is None or admit(d, ids):
            batch.append(d)
            prompts.append(ids)
    return batch, prompts


def _generate_turn(batch: list[Dialogue], prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                   generate: Generate, tokenizer: Any,
                   on_answer: Callable[[Dialogue, GenerationOutput, str], bool] | None,
                   on_done: Callable[[Dialogue], None] | None) -> list[Dialogue]:
    """One turn of `batch`: record each answer as it arrives; return the dialogues that have another turn."""
    following: list[int] = []

    def finished(i: int, out: GenerationOutput) -> None:
        d = batch[i]
        text = answer_text(tokenizer, out)
        if on_answer is not None and not on_answer(d, out, text):
            return
        d.answers.append(text)
        d.finish_reasons.append(out.finish_reason)
        d.gen_tokens.append(len(out.output_ids))
        if not d.done:
            following.append(i)
        elif on_done is not None:
            on_done(d)

    generate(prompts, params, finished)
    return [batch[i] for i in sorted(following)]  # a fixed submission order, whatever the completion order


def answer(engine: LLMEngine, tokenizer: Any, convs: Sequence[Conversation], params: SamplingParams,
           template_kwargs: Mapping[str, Any] | None = None, progress: bool = False) -> list[list[GenerationOutput]]:
    """Every user turn of every conversation answered by `engine`, turn by turn, each turn after the model's own
    answers (`mtp_train.engine.turns`); the outputs per conversation, per user turn.

    Request i of a turn is seeded with params.seed + i (the engine's rule for one setting for all).
    """
    dialogues = [Dialogue.of(c.messages, key=i) for i, c in enumerate(convs)]
    outputs: list[list[GenerationOutput]] = [[] for _ in convs]

    def keep(d: Dialogue, out: GenerationOutput, text: str) -> bool:
        outputs[d.key].append(out)
        return True

    def generate(prompts: list[list[int]], p: SamplingParams | list[SamplingParams], on_finish: OnFinish) -> None:
        engine.generate(prompts, p, on_finish=on_finish, progress=progress)

    answer_turns(dialogues, generate, tokenizer, params, template_kwargs=template_kwargs, on_answer=keep)
    return outputs
