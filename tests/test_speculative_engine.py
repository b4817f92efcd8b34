"""Speculative decoding through the engine: greedy output equals plain greedy output, the head's catch-up state
equals a recompute, sampled output follows the target's distribution, and a bad head is refused."""

from __future__ import annotations

import pytest
import torch

from mtp_train.config import HeadConfig
from mtp_train.engine import LLMEngine, SamplingParams, SeqStatus, prefill_hidden
from mtp_train.engine.kv_cache import KVCache
from mtp_train.head_types.chain import HeadProposer
from mtp_train.heads import build_head
from mtp_train.layers import AttentionMetadata
from mtp_train.models import load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import DraftModelProposer, NgramProposer
from mtp_train.speculative.tree import Accepted, layout
from mtp_train.speculative.tree_draft import TreeSpec

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[3, 17, 42], [5, 9, 11, 200, 7, 1, 8], list(range(20, 33)), [250] * 2 + list(range(40, 58))]


def _greedy(model, prompts, n=20, page_size=3):
    out = LLMEngine(model, page_size=page_size, num_pages=256).generate(
        prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [o.output_ids for o in out]


def _head(tiny_checkpoints, name="llama", draft_vocab_size=0, seed=0):
    torch.manual_seed(seed)
    return build_head(HeadConfig(type="mtp", init="last_layer", draft_vocab_size=draft_vocab_size),
                      tiny_checkpoints[name][0])


def _eagle3(tiny_checkpoints, name="llama", seed=0):
    torch.manual_seed(seed)
    return build_head(HeadConfig(type="eagle3", draft_vocab_size=96), tiny_checkpoints[name][0])


def _sharp_head(tiny_checkpoints, draft_vocab_size=0):
    """An untrained head whose draft confidences spread over (0.15, 0.75): its final norm scaled up 20×."""
    head = _head(tiny_checkpoints, draft_vocab_size=draft_vocab_size)
    with torch.no_grad():
        head.norm.weight.mul_(20.0)
    return head


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_greedy_mtp_equals_plain_greedy(tiny_checkpoints, name, k):
    model = load_model(tiny_checkpoints[name][0])
    ref = _greedy(model, PROMPTS)
    eng = SpecEngine(model, HeadProposer(_head(tiny_checkpoints, name)), k, page_size=3, num_pages=256)
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [o.output_ids for o in out] == ref
    m = eng.stats.metrics
    assert m.num_drafts >= eng.stats.verify_steps  # one drafting step per sequence and verify step
    assert 1.0 <= m.mean_acceptance_length <= k + 1
    assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages  # every page came back
    # per request: one entry per prompt, adding up to the totals (τ's standard error is taken over them)
    assert len(m.by_request) == len(PROMPTS)
    assert sum(c[0] for c in m.by_request.values()) == m.num_drafts
    assert sum(c[1] for c in m.by_request.values()) == m.num_accepted


@pytest.mark.parametrize(("kind", "k"), [("mtp", 1), ("mtp", 3), ("eagle3", 2)])
def test_a_head_streaming_bf16_weights_keeps_plain_greedy_output(tiny_checkpoints, kind, k):
    """`stream_weights("bf16")` (mtp-eval's head_weights=bf16): the head drafts from bfloat16 copies of its weights,
    and the target's verification keeps every answer plain greedy's; switched off, the head's own weights serve
    again."""
    model = load_model(tiny_checkpoints["llama"][0])
    ref = _greedy(model, PROMPTS)
    head = _eagle3(tiny_checkpoints) if kind == "eagle3" else _head(tiny_checkpoints, draft_vocab_size=96)
    assert head.stream_weights("bf16") >= 5  # fc (and the aux fc), attention and MLP projections
    w = head.draft_lm_head()
    with torch.no_grad():  # inference only: a trainable lm_head (eagle3's) under autograd keeps its own weight
        assert head.lm_rows_copy(w).dtype == torch.bfloat16
    eng = SpecEngine(model, HeadProposer(head), k, page_size=3, num_pages=256)
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [o.output_ids for o in out] == ref
    assert eng.stats.metrics.num_draft_tokens > 0
    with torch.no_grad():
        assert head.stream_weights(None) == 0 and head.lm_rows_copy(w) is None


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_eagle3_equals_plain_greedy_and_reads_the_aux_layers(tiny_checkpoints, name, k):
    model = load_model(tiny_checkpoints[name][0])
    ref = _greedy(model, PROMPTS)
    head = _eagle3(tiny_checkpoints, name)
    proposer = HeadProposer(head)
    assert proposer.hidden_layers == (2, 1, 0)
    eng = SpecEngine(model, proposer, k, page_size=3, num_pages=256)
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [o.output_ids for o in out] == ref
    assert eng.stats.metrics.num_drafts >= eng.stats.verify_steps
    assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages


def _assert_catch_up_state_is_a_recompute(model, head, inputs_of) -> None:
    """After every step the head's kept feature ĥ_{L-1} is what a cache-free prefill of the head over the target's
    rows of the whole accepted sequence gives; inputs_of(ids) → (L-1, W) those rows (hidden or aux layers)."""
    proposer = HeadProposer(head)
    eng = SpecEngine(model, proposer, 3, page_size=3, num_pages=256)
    for p in PROMPTS:
        eng.add_request(p, SamplingParams(max_new_tokens=16, ignore_eos=True))
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for s in eng.running:
            ids = s.token_ids[:-1]  # t_0..t_{L-2}: rows 0..L-2 read (h_i, t_{i+1})
            with torch.no_grad():
                ref = head(inputs_of(ids), torch.tensor(s.token_ids[1:]),
                           AttentionMetadata.build([len(ids)]), from_target=True).hidden[-1]
            torch.testing.assert_close(proposer._feat[s.seq_id], ref, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked > 10


def test_eagle3_catch_up_state_equals_a_recompute_over_the_targets_aux_layers(tiny_checkpoints):
    """The eagle3 head's kept feature is a recompute over the target's aux layers (2, 1, 0): the verify forward
    handed it those layers."""
    model = load_model(tiny_checkpoints["llama"][0])

    def aux(ids):
        out = prefill_hidden(model, [ids], hidden_layers=[2, 1, 0])
        return torch.cat([out.layers[j] for j in (2, 1, 0)], -1)

    _assert_catch_up_state_is_a_recompute(model, _eagle3(tiny_checkpoints), aux)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_draft_model_equals_plain_greedy(tiny_checkpoints, k):
    target = load_model(tiny_checkpoints["llama"][0])
    ref = _greedy(target, PROMPTS)
    # Another model of the same vocabulary drafts: few acceptances, same output.
    other = SpecEngine(target, DraftModelProposer(load_model(tiny_checkpoints["llama-tied"][0])), k, page_size=3,
                       num_pages=256)
    assert [o.output_ids for o in other.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))] == ref
    # The target drafting for itself: every draft accepted, τ = k + 1 exactly, and still the same output.
    own = SpecEngine(target, DraftModelProposer(target), k, page_size=3, num_pages=256)
    assert [o.output_ids for o in own.generate(PROMPTS, SamplingParams(max_new_tokens=21, ignore_eos=True))] == \
        _greedy(target, PROMPTS, 21)
    m = own.stats.metrics
    assert m.acceptance_rate == 1.0 and m.per_position == [1.0] * k
    assert m.mean_acceptance_length == k + 1


def test_untrained_head_gives_correct_output_with_low_tau(tiny_checkpoints):
    model = load_model(tiny_checkpoints["llama"][0])
    eng = SpecEngine(model, HeadProposer(_head(tiny_checkpoints, draft_vocab_size=64)), 4, page_size=3,
                     num_pages=256)
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [o.output_ids for o in out] == _greedy(model, PROMPTS)
    assert eng.stats.metrics.mean_acceptance_length < 1.5


def test_stop_tokens_and_max_new_tokens_cut_a_multi_token_step(tiny_checkpoints):
    model = load_model(tiny_checkpoints["llama"][0])
    ref = _greedy(model, PROMPTS, 12)
    stop = ref[1][5]  # the 6th token of prompt 1 becomes a stop token
    params = SamplingParams(max_new_tokens=12, stop_token_ids=[stop])
    plain = LLMEngine(model, page_size=3, num_pages=256).generate(PROMPTS, params)
    spec = SpecEngine(model, DraftModelProposer(model), 4, page_size=3, num_pages=256).generate(PROMPTS, params)
    assert [(o.output_ids, o.finish_reason) for o in spec] == [(o.output_ids, o.finish_reason) for o in plain]
    assert spec[1].output_ids[-1] == stop and spec[1].finish_reason == "stop"
    assert all(len(o.output_ids) <= 12 for o in spec)


def test_head_catch_up_state_equals_a_recompute_over_the_accepted_sequence(tiny_checkpoints):
    """The head's kept feature is a recompute over the target's hidden states of the whole accepted sequence: the
    catch-up overwrote every chain entry."""
    model = load_model(tiny_checkpoints["qwen3"][0])
    _assert_catch_up_state_is_a_recompute(model, _head(tiny_checkpoints, "qwen3"),
                                          lambda ids: prefill_hidden(model, [ids]).hidden)


def _marginal_of_second_token(model, prompt, temperature):
    """Exact P(t2 | prompt) = Σ_t1 p(t1 | prompt) p(t2 | prompt, t1) of the target at `temperature`."""
    from mtp_train.engine.sampling import filtered_probs

    v = model.args.vocab_size
    with torch.no_grad():
        first = filtered_probs(model(torch.tensor(prompt), AttentionMetadata.build([len(prompt)]), None,
                                     logits_indices=torch.tensor([len(prompt) - 1])).logits[0], temperature)
        seqs = [prompt + [t] for t in range(v)]
        n = len(prompt) + 1
        out = model(torch.tensor([t for s in seqs for t in s]), AttentionMetadata.build([n] * v), None,
                    logits_indices=torch.arange(v) * n + n - 1).logits
        second = filtered_probs(out, temperature)  # (V, V): row t1
    return (first[:, None] * second).sum(0)


@pytest.mark.parametrize("proposer", ["head", "head-threshold", "head-tree", "head-width", "head-bf16", "eagle3",
                                      "draft", "ngram"])
def test_sampled_speculation_follows_the_target_distribution(tiny_checkpoints, proposer):
    """Chi-square: the second generated token (the first one that goes through speculative acceptance) of many
    seeded requests is distributed as the target's exact marginal (fixed seeds; bins with expected < 5 merged).
    Covers variable draft lengths (a threshold), a deterministic proposer (prompt lookup: q one-hot) and draft
    trees: a dynamic one of width 3, depth 3 and the first-draft width (multi-candidate rejection sampling), and a
    head drafting from bfloat16 copies of its weights."""
    model = load_model(tiny_checkpoints["llama"][0])
    # prompt lookup drafts when the first sampled token occurs in the prompt: give it many tokens to match
    prompt = [3, 17, 42, 7] + (list(range(60, 120)) if proposer == "ngram" else [])
    temp, n = 0.7, 3000
    expected_p = _marginal_of_second_token(model, prompt, temp)
    if proposer == "eagle3":
        prop = HeadProposer(_eagle3(tiny_checkpoints))
    elif proposer == "head-tree":
        prop = HeadProposer(_head(tiny_checkpoints, draft_vocab_size=96), tree=TreeSpec(3, 3, 16))
    elif proposer == "head-width":
        prop = HeadProposer(_head(tiny_checkpoints, draft_vocab_size=96), draft_width=3)
    elif proposer == "head-bf16":  # q is the bfloat16 copies' distribution: still lossless
        head = _head(tiny_checkpoints, draft_vocab_size=96)
        head.stream_weights("bf16")
        prop = HeadProposer(head)
    elif proposer.startswith("head"):
        prop = (HeadProposer(_sharp_head(tiny_checkpoints, 96), draft_threshold=0.4) if proposer == "head-threshold"
                else HeadProposer(_head(tiny_checkpoints, draft_vocab_size=96)))
    elif proposer == "ngram":
        prop = NgramProposer()
    else:
        prop = DraftModelProposer(load_model(tiny_checkpoints["llama-tied"][0]))
    eng = SpecEngine(model, prop, 3, page_size=4, num_pages=4096, max_batch_size=256)
    outs = eng.generate([prompt] * n, SamplingParams(temperature=temp, max_new_tokens=2, ignore_eos=True, seed=1234))
    assert eng.stats.metrics.num_draft_tokens > 0
    assert_second_tokens_follow(outs, expected_p)


def assert_second_tokens_follow(outs, expected_p: torch.Tensor) -> None:
    """χ² test: the outputs' second tokens are distributed as `expected_p` (V,) (`_marginal_of_second_token`)."""
    n = len(outs)
    counts = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=expected_p.numel()).double()
    exp = expected_p.double() * n
    big = exp >= 5
    obs_b, exp_b = counts[big], exp[big]
    if (~big).any():  # the small bins merged into one
        obs_b, exp_b = torch.cat([obs_b, counts[~big].sum()[None]]), torch.cat([exp_b, exp[~big].sum()[None]])
    chi2 = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    dof = obs_b.numel() - 1
    # 99.9% quantile of chi-square(dof) by Wilson–Hilferty; a wrong rule (e.g. accepting q-samples as they
    # are) is off by hundreds here.
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < limit, (chi2, limit, dof)


def test_self_draft_accepts_everything_when_sampling(tiny_checkpoints):
    """p and q come from the same processing (temperature, top-k, top-p): a model drafting for itself is always
    accepted, so the rule's min(1, p/q) is exactly 1."""
    model = load_model(tiny_checkpoints["llama"][0])
    eng = SpecEngine(model, DraftModelProposer(model), 3, page_size=4, num_pages=256)
    eng.generate(PROMPTS, SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_new_tokens=13, ignore_eos=True,
                                         seed=3))
    assert eng.stats.metrics.acceptance_rate == 1.0


def test_invalid_k_is_refused(tiny_checkpoints):
    model = load_model(tiny_checkpoints["llama"][0])
    with pytest.raises(ValueError, match="k"):
        SpecEngine(model, DraftModelProposer(model), 0)


def test_prompt_lookup_finds_the_longest_most_recent_match():
    ng = NgramProposer(n_max=3, n_min=1)
    # suffix [7, 8, 9] occurs at 0 and 5: the most recent one is followed by 4, 4
    assert ng.lookup([7, 8, 9, 1, 2, 7, 8, 9, 4, 4, 7, 8, 9], 2) == [4, 4]
    # no 3- or 2-gram match: the 1-gram [5] occurs last at index 2, followed by 6, 1
    assert ng.lookup([1, 5, 5, 6, 1, 3, 5], 2) == [6, 1]
    # the continuation is cut at the end of the sequence
    assert ng.lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2]
    assert ng.lookup([1, 2, 3, 4], 3) == []  # nothing repeats
    assert NgramProposer(n_max=3, n_min=2).lookup([1, 5, 2, 5], 3) == []  # only a 1-gram would match
    with pytest.raises(ValueError, match="n_min"):
        NgramProposer(n_max=1, n_min=2)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_prompt_lookup_equals_plain_greedy(tiny_checkpoints, k):
    model = load_model(tiny_checkpoints["llama"][0])
    prompts = PROMPTS + [[9, 8, 7, 6] * 5]  # a looping prompt: the lookup drafts from the first step
    ref = _greedy(model, prompts, 24)
    eng = SpecEngine(model, NgramProposer(), k, page_size=3, num_pages=256)
    out = eng.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.output_ids for o in out] == ref
    m = eng.stats.metrics
    assert m.num_draft_tokens > 0 and m.num_empty > 0  # some steps drafted, some found no match
    assert m.mean_draft_length < k or k == 1
    assert 1.0 <= m.mean_acceptance_length <= k + 1
    assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages


@pytest.mark.parametrize("threshold", [0.3, 0.6])
def test_dynamic_draft_length_keeps_greedy_output(tiny_checkpoints, threshold):
    model = load_model(tiny_checkpoints["llama"][0])
    ref = _greedy(model, PROMPTS)
    head = _sharp_head(tiny_checkpoints)
    fixed = SpecEngine(model, HeadProposer(head), 4, page_size=3, num_pages=256)
    fixed.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert fixed.stats.metrics.mean_draft_length == 4
    eng = SpecEngine(model, HeadProposer(head, draft_threshold=threshold), 4, page_size=3, num_pages=256)
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [o.output_ids for o in out] == ref
    m = eng.stats.metrics
    assert m.mean_draft_length < 4  # some chains stopped before k
    assert m.num_empty > 0  # and some before their first draft
    assert m.num_draft_tokens > 0
    assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages
    with pytest.raises(ValueError, match="draft_threshold"):
        HeadProposer(head, draft_threshold=1.0)


def _row(pool: torch.Tensor, pages: list[int], pos: int, page_size: int) -> torch.Tensor:
    """The head cache's (2, Hkv, D) K/V entry at a token position."""
    return pool[pages[pos // page_size], :, pos % page_size].clone()


@pytest.mark.parametrize("mode", ["target", "own"])
def test_catch_up_modes_keep_or_rewrite_the_chain_rows(tiny_checkpoints, mode):
    """After a step that accepted 2 of 3 drafts: catch_up=own keeps the rows the chain wrote for d_1, d_2
    (positions L-1, L) and writes only row L+1 from the target's h; catch_up=target rewrites all three from
    the target's hidden states, so only then is the kept ĥ what a recompute over the sequence gives."""
    model = load_model(tiny_checkpoints["llama"][0])
    prop = HeadProposer(_head(tiny_checkpoints), catch_up=mode)
    eng = SpecEngine(model, prop, 3, page_size=3, num_pages=64)
    eng.add_request(PROMPTS[3], SamplingParams(max_new_tokens=16, ignore_eos=True))
    eng.step()  # prefill: the prompt and the first token
    (seq,) = eng.running
    L = len(seq)
    eng.runner.kv.ensure(seq.pages, L + 3)
    tree = prop.propose([seq], 3)[0]
    drafts = tree.tokens
    chain = [_row(prop.kv.layers[0], seq.pages, L - 1 + j, 3) for j in range(2)]  # rows of d_1, d_2
    hidden = prefill_hidden(model, [seq.token_ids + drafts]).hidden[L - 1:L + 3]  # h at L-1..L+2
    seq.token_ids.extend(drafts[:2] + [7])  # pretend d_1, d_2 were accepted and the target said 7
    prop.update([seq], [L], [tree], [[0, 1]], [hidden[:3]])  # the root, d_1, d_2
    after = [_row(prop.kv.layers[0], seq.pages, L - 1 + j, 3) for j in range(2)]
    kept = [torch.equal(a, b) for a, b in zip(after, chain)]
    assert kept == ([True, True] if mode == "own" else [False, False])
    # The kept ĥ is a recompute over the target's hidden states of the whole sequence only for catch_up=target.
    ids = seq.token_ids[:-1]
    with torch.no_grad():
        ref = prop.head(prefill_hidden(model, [ids]).hidden, torch.tensor(seq.token_ids[1:]),
                        AttentionMetadata.build([len(ids)]), from_target=True).hidden[-1]
    assert torch.allclose(prop._feat[seq.seq_id], ref, rtol=1e-4, atol=1e-4) == (mode == "target")


def test_own_catch_up_gives_plain_greedy_output(tiny_checkpoints):
    model = load_model(tiny_checkpoints["qwen3"][0])
    ref = _greedy(model, PROMPTS)
    eng = SpecEngine(model, HeadProposer(_head(tiny_checkpoints, "qwen3"), catch_up="own"), 3, page_size=3,
                     num_pages=256)
    assert [o.output_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))] == ref
    with pytest.raises(ValueError, match="catch_up"):
        HeadProposer(_head(tiny_checkpoints), catch_up="draft")


@pytest.mark.parametrize("catch_up", ["target", "own"])
@pytest.mark.parametrize(("name", "k"), [("llama", 1), ("llama", 3), ("qwen3", 2)])
def test_first_draft_siblings_keep_greedy_output_and_save_missed_steps(tiny_checkpoints, name, k, catch_up):
    """draft_width 24 over the tiny 256-token vocabulary: the head's runners-up are verified beside its chain in
    one tree step; where the target's token is one of them it is accepted with its bonus token, and the output
    stays plain greedy's, with every page back. With the same head and k, only tau can grow."""
    model = load_model(tiny_checkpoints[name][0])
    ref = _greedy(model, PROMPTS)
    head = _head(tiny_checkpoints, name)
    chain = SpecEngine(model, HeadProposer(head, catch_up=catch_up), k, page_size=3, num_pages=256)
    chain.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    eng = SpecEngine(model, HeadProposer(head, catch_up=catch_up, draft_width=24), k, page_size=3, num_pages=256)
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [o.output_ids for o in out] == ref
    m = eng.stats.metrics
    assert m.num_branch_accepted > 0 and m.num_branch_tokens == 23 * m.num_drafts
    assert m.per_position[0] > chain.stats.metrics.per_position[0]
    assert m.mean_acceptance_length > chain.stats.metrics.mean_acceptance_length
    assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages and eng.runner.kv.reserved == 0


def _state(s):
    """What a step could change of a sequence: its tokens, its cache count and its pages."""
    return list(s.token_ids), s.num_cached, list(s.pages)


@pytest.mark.parametrize("drafter", ["none", "ngram", "self", "head", "tree"])
def test_only_the_scheduler_changes_a_sequence(tiny_checkpoints, drafter):
    """Stepping the engine as `LLMEngine.step` does (schedule → run → postprocess): every forward of the target,
    the verify included, sees the sequences as `schedule` left them, and the step's run leaves them so (no drafts
    appended and taken back, no cache count moved); the scheduler's postprocess alone appends the step's tokens
    and leaves every running sequence with all but its newest token cached. The output stays plain greedy's."""
    model = load_model(tiny_checkpoints["llama"][0])
    prompts = PROMPTS + [[9, 8, 7, 6] * 5]  # a looping prompt: drafts accepted from the first step
    ref = _greedy(model, prompts)
    proposers = {"ngram": lambda: NgramProposer(), "self": lambda: DraftModelProposer(model),  # all accepted
                 "head": lambda: HeadProposer(_head(tiny_checkpoints)),
                 "tree": lambda: HeadProposer(_head(tiny_checkpoints), draft_width=24)}
    eng = (LLMEngine(model, page_size=3, num_pages=256) if drafter == "none" else
           SpecEngine(model, proposers[drafter](), 3, page_size=3, num_pages=256))
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in prompts]
    scheduled: dict[int, tuple] = {}
    forwards = []

    def unchanged(module, args) -> None:
        forwards.append({i: _state(s) for s in seqs if (i := s.seq_id) in scheduled} == scheduled)

    hook = model.register_forward_pre_hook(unchanged)
    try:
        while eng.has_unfinished():
            batch, prefill = eng.scheduler.schedule()
            scheduled = {s.seq_id: _state(s) for s in batch}
            assert all(s.num_cached == (0 if prefill else len(s) - 1) for s in batch)
            tokens = eng.stepper.run(batch, prefill, eng.stats)
            assert {s.seq_id: _state(s) for s in batch} == scheduled
            eng.scheduler.postprocess(batch, tokens)
            for s, new in zip(batch, tokens):
                appended = s.token_ids[len(scheduled[s.seq_id][0]):]
                assert appended == new or (s.status is SeqStatus.FINISHED and appended == new[:len(appended)])
                assert s.num_cached == (len(s) - 1 if s.status is SeqStatus.RUNNING else 0)
            eng.stepper.postprocess(batch, eng.stats)
    finally:
        hook.remove()
    assert forwards and all(forwards)
    assert [s.output_ids for s in seqs] == ref
    if drafter not in ("none", "head"):  # (an untrained head's chain is rarely right)
        assert eng.stats.metrics.num_accepted > 0
    assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages and eng.runner.kv.reserved == 0


def test_wide_trees_need_a_sane_width(tiny_checkpoints):
    head = _head(tiny_checkpoints, "mistral")  # a sliding window: trees run there too (tests/test_tree_windows.py)
    for bad in (0, 33):
        with pytest.raises(ValueError, match="draft_width"):
            HeadProposer(head, draft_width=bad)


def test_sampled_sequences_draft_trees_beside_greedy_ones(tiny_checkpoints):
    """One batch, a greedy request and a sampled one: both are verified as trees (the sampled one by multi-candidate
    rejection sampling), and the greedy answer is still plain greedy's."""
    model = load_model(tiny_checkpoints["llama"][0])
    ref = _greedy(model, PROMPTS[:1])
    eng = SpecEngine(model, HeadProposer(_head(tiny_checkpoints), draft_width=8), 2, page_size=3, num_pages=256)
    out = eng.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=20, ignore_eos=True),
                                     SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=1.0, seed=3)])
    assert out[0].output_ids == ref[0] and len(out[1].output_ids) == 20
    m = eng.stats.metrics
    assert m.num_branch_tokens == 7 * m.num_drafts  # siblings for both requests


@pytest.mark.slow
def test_greedy_eagle3_on_the_default_model_equals_plain_greedy(default_model_dir):
    """SmolLM2-135M (30 layers): an eagle3 head over hidden_states 2, 15, 27 changes no greedy token."""
    model = load_model(default_model_dir, dtype="float32")
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="eagle3", draft_vocab_size=8192), default_model_dir, dtype="float32")
    assert head.aux_layers == [2, 15, 27]
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9519, 9, 2683, 359, 346, 47]]
    ref = _greedy(model, prompts, n=24, page_size=16)
    eng = SpecEngine(model, HeadProposer(head), 3, page_size=16, num_pages=64)
    out = eng.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.output_ids for o in out] == ref


def _draft_and_verify(eng, prop, seq):
    """`seq`'s draft and the target's verify forward over its rows, driven by hand: (tree, rows, step, out)."""
    n = len(seq)
    eng.runner.kv.ensure(seq.pages, n + eng.spec.span)
    tree = prop.propose([seq], eng.k)[0]
    rows = layout([tree], [seq.token_ids[-1]], [n])
    step = rows.step_rows([seq.pages])
    return tree, rows, step, eng.runner.forward(step, logits="all")


def _verify_by_hand(eng, prop, seq, path, bonus):
    """One speculative step of `seq` driven by hand with a chosen outcome: draft, verify, accept the nodes `path`
    and the target token `bonus` after them (whatever the target said), move the target's path K/V into place
    and let the head catch up in its one forward over the verify rows (`after_verify`); extend the sequence."""
    tree, rows, step, out = _draft_and_verify(eng, prop, seq)
    acc = Accepted(list(path), [tree.tokens[j] for j in path] + [bonus])
    for src, dst in rows.moves(0, acc.path):
        eng.runner.kv.copy_token(seq.pages, src, dst)
    assert prop.after_verify([seq], rows, step, None, out.hidden, [acc])
    seq.token_ids.extend(acc.tokens)
    seq.num_cached = len(seq) - 1


def _assert_head_cache_is_a_prefill(model, prop, seq, page_size):
    """The head's cache at positions 0..L-2 holds what a head prefill over the target's hidden states of the whole
    sequence writes (rows of rejected drafts nowhere among them), and its kept ĥ is that prefill's last output."""
    head = prop.head
    layers, kv_layout = head.kv_shape
    ref = KVCache(layers, prop.kv.num_pages, page_size, kv_layout, dtype=head.dtype, device=head.device)
    ids = seq.token_ids[:-1]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [seq.pages], page_size)
    with torch.no_grad():
        out = head(prefill_hidden(model, [ids]).hidden, torch.tensor(seq.token_ids[1:]), meta, ref.layers[0],
                   from_target=True).hidden
    for pos in range(len(ids)):
        torch.testing.assert_close(_row(prop.kv.layers[0], seq.pages, pos, page_size),
                                   _row(ref.layers[0], seq.pages, pos, page_size), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, pos=pos: f"head K/V at position {pos} of {len(ids)}: {m}")
    torch.testing.assert_close(prop._feat[seq.seq_id], out[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("width", "k", "paths"), [
    (1, 3, [[0], [0, 1, 2], [], [0, 1]]),  # a rejection after d_1, then the whole chain, then none, then two
    (2, 2, [[2], [0, 1], [2], []]),  # the first draft's sibling (a path off the first slots), then the chain
])
def test_catch_up_in_the_verify_rows_commits_the_accepted_rows_only(tiny_checkpoints, width, k, paths):
    """The head's one forward over every verify row writes K/V for the rejected drafts too: after a rejection
    followed by acceptances, its cache up to the new length must still be the prefill's exactly (a rejected row
    counted, a row shifted by one, a tree path not moved to its positions or the bonus token misplaced fail)."""
    model = load_model(tiny_checkpoints["llama"][0])
    prop = HeadProposer(_head(tiny_checkpoints), draft_width=width)
    eng = SpecEngine(model, prop, k, page_size=3, num_pages=64)
    eng.add_request(PROMPTS[3], SamplingParams(max_new_tokens=32, ignore_eos=True))
    eng.step()  # the prompt's prefill: the target's and the head's
    (seq,) = eng.running
    _assert_head_cache_is_a_prefill(model, prop, seq, 3)
    for i, path in enumerate(paths):
        _verify_by_hand(eng, prop, seq, path, bonus=7 + i)
        _assert_head_cache_is_a_prefill(model, prop, seq, 3)


@pytest.mark.parametrize("paths", [[[0], [0, 1, 2], [], [0, 1]]])
def test_greedy_catch_up_from_the_argmax_alone_commits_the_accepted_rows_only(tiny_checkpoints, paths):
    """`catch_up_greedy` reads only the target's argmax over the verify rows (a device tensor): given the argmax
    that accepts a chosen path and bonus, the head's cache and kept feature are the prefill's, as `after_verify`
    leaves them, with no accepted path handed to it; a tree or a ragged batch is left to `after_verify`."""
    model = load_model(tiny_checkpoints["llama"][0])
    prop = HeadProposer(_head(tiny_checkpoints))
    eng = SpecEngine(model, prop, 3, page_size=3, num_pages=64)
    eng.add_request(PROMPTS[3], SamplingParams(max_new_tokens=32, ignore_eos=True))
    eng.step()
    (seq,) = eng.running
    for i, path in enumerate(paths):
        tree, rows, step, out = _draft_and_verify(eng, prop, seq)
        bonus = 7 + i
        argmax = [*(tree.tokens[j] for j in path), bonus] + [0] * (len(tree) - len(path))  # rows after n: discarded
        assert prop.catch_up_greedy([seq], rows, step, None, out.hidden, torch.tensor(argmax))
        seq.token_ids.extend([tree.tokens[j] for j in path] + [bonus])
        seq.num_cached = len(seq) - 1
        _assert_head_cache_is_a_prefill(model, prop, seq, 3)
    wide = HeadProposer(_head(tiny_checkpoints), draft_width=2)
    eng2 = SpecEngine(model, wide, 2, page_size=3, num_pages=64)
    eng2.add_request(PROMPTS[3], SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng2.step()
    (seq2,) = eng2.running
    eng2.runner.kv.ensure(seq2.pages, len(seq2) + eng2.spec.span)
    tree = wide.propose([seq2], 2)[0]
    rows = layout([tree], [seq2.token_ids[-1]], [len(seq2)])
    step = rows.step_rows([seq2.pages])
    out = eng2.runner.forward(step, logits="all")
    assert not wide.catch_up_greedy([seq2], rows, step, None, out.hidden, out.logits.argmax(-1))
