"""The scheduler on its own (no model): admission under a page budget, reservations that come back when a sequence
finishes, a step's extra rows in the reservation, and two schedulers sharing one pool."""

from __future__ import annotations

import pytest

from mtp_train.engine import KVCache, OutOfPagesError, SamplingParams, Sequence
from mtp_train.engine.scheduler import Scheduler
from mtp_train.engine.sequence import SeqStatus
from mtp_train.layers.attention import KVLayout


def _pool(num_pages: int, page_size: int = 4) -> KVCache:
    return KVCache(1, num_pages, page_size, KVLayout(num_kv_heads=1, head_dim=2))


def _seq(i: int, prompt_len: int, new: int) -> Sequence:
    return Sequence.new(i, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=new, ignore_eos=True))


def _run_step(sched: Scheduler, batch: list[Sequence], token: int = 7) -> list[Sequence]:
    """A plain step after `schedule`: it changes no sequence and emits one token each; postprocess appends it."""
    return sched.postprocess(batch, [[token]] * len(batch))


def test_admission_stops_at_the_page_budget_and_the_batch_limits():
    kv = _pool(10)
    sched = Scheduler(kv, max_batch_size=3, max_batch_tokens=100)
    for i in range(4):
        sched.add(_seq(i, 6, 6))  # 12 tokens: 3 pages each
    batch, prefill = sched.schedule()
    assert prefill and [s.seq_id for s in batch] == [0, 1, 2] and kv.reserved == 9  # 3 fit in 10 pages
    assert all(s.status is SeqStatus.RUNNING for s in batch) and len(sched.waiting) == 1
    again, prefill = sched.schedule()
    assert not prefill and again == batch  # no room: the running sequences decode
    assert (sched.stats.prefill_steps, sched.stats.decode_steps, sched.stats.prompt_tokens) == (1, 1, 18)
    tokens = Scheduler(_pool(100), max_batch_size=8, max_batch_tokens=10)
    for i in range(3):
        tokens.add(_seq(i, 6, 2))
    assert len(tokens.schedule()[0]) == 1  # the second prompt would pass 10 prefill tokens
    with pytest.raises(OutOfPagesError, match="needs 11 pages"):
        sched.add(_seq(9, 30, 12))


def test_reservations_come_back_when_sequences_finish():
    kv = _pool(8)
    sched = Scheduler(kv, max_batch_size=4, max_batch_tokens=100)
    sched.add(_seq(0, 3, 2))  # 5 tokens: 2 pages
    sched.add(_seq(1, 3, 5))  # 8 tokens: 2 pages
    batch, _ = sched.schedule()
    assert kv.reserved == 4
    assert _run_step(sched, batch) == []
    batch, _ = sched.schedule()
    (done,) = _run_step(sched, batch)  # the first reaches max_new_tokens = 2
    assert done.seq_id == 0 and done.finish_reason == "length" and done.status is SeqStatus.FINISHED
    assert kv.reserved == 2 and done.pages == [] and [s.seq_id for s in sched.running] == [1]
    while sched.has_unfinished():
        batch, _ = sched.schedule()
        _run_step(sched, batch)
    assert kv.reserved == 0 and kv.allocator.num_free == kv.num_pages
    assert sched.stats.generated_tokens == 2 + 5


def test_a_stop_token_ends_a_multi_token_step_and_drops_the_rest():
    sched = Scheduler(_pool(8), max_batch_size=1, max_batch_tokens=100)
    seq = Sequence.new(0, [1, 2], SamplingParams(max_new_tokens=8, stop_token_ids=[9]))
    sched.add(seq)
    batch, _ = sched.schedule()
    assert sched.postprocess(batch, [[4, 9, 5]]) == [seq]
    assert seq.output_ids == [4, 9] and seq.finish_reason == "stop" and sched.stats.generated_tokens == 2


def test_extra_rows_are_reserved_with_the_sequence():
    """A speculative step holds its draft tree beyond a sequence's longest length: those rows are promised too."""
    kv = _pool(16)
    sched = Scheduler(kv, max_batch_size=4, max_batch_tokens=100, extra_tokens=6)
    seq = _seq(0, 4, 4)  # 8 tokens + 6 rows: 4 pages
    assert sched.reserve_tokens(seq) == 14
    sched.add(seq)
    sched.schedule()
    assert kv.reserved == 4


def test_the_scheduler_grows_the_pages_and_counts_the_cache():
    """`schedule` gives each sequence of the batch pages for its tokens and the step's extra rows (within its
    reservation); `postprocess` appends the step's tokens and counts all but the newest cached, however many the
    step emitted."""
    kv = _pool(16)
    sched = Scheduler(kv, max_batch_size=4, max_batch_tokens=100, extra_tokens=5)
    seq = _seq(0, 6, 7)  # 13 tokens + 5 rows: 5 pages reserved
    sched.add(seq)
    batch, prefill = sched.schedule()
    assert prefill and seq.num_cached == 0 and len(seq.pages) == 3 == kv.pages_for(6 + 5)
    assert sched.postprocess(batch, [[7]]) == [] and (len(seq), seq.num_cached) == (7, 6)
    batch, _ = sched.schedule()
    assert len(seq.pages) == kv.pages_for(7 + 5)
    assert sched.postprocess(batch, [[8, 9, 10]]) == [] and (len(seq), seq.num_cached) == (10, 9)  # a verify step
    batch, _ = sched.schedule()
    assert len(seq.pages) == kv.pages_for(10 + 5) <= kv.reserved == 5
    with pytest.raises(ValueError, match="emitted no token"):
        sched.postprocess(batch, [[]])


def test_two_schedulers_on_one_pool_admit_against_one_count():
    kv = _pool(10)
    a = Scheduler(kv, max_batch_size=4, max_batch_tokens=100)
    b = Scheduler(kv, max_batch_size=4, max_batch_tokens=100, extra_tokens=4)
    a.hold(2)  # e.g. one engine's CUDA-graph scratch pages, out of the pool for good
    a.add(_seq(0, 10, 2))  # 12 tokens: 3 pages
    b.add(_seq(1, 6, 6))  # 12 + 4 tokens: 4 pages
    b.add(_seq(2, 2, 2))  # 4 + 4 tokens: 2 pages
    (first,), _ = a.schedule()
    assert kv.reserved == 5
    batch, _ = b.schedule()
    assert [s.seq_id for s in batch] == [1] and kv.reserved == 9  # the second no longer fits beside the others
    while a.has_unfinished():
        _run_step(a, a.schedule()[0])
    assert kv.reserved == 6 and first.status is SeqStatus.FINISHED
    batch, prefill = b.schedule()
    assert prefill and [s.seq_id for s in batch] == [2] and kv.reserved == 8  # admitted once the other engine freed
    while b.has_unfinished():
        _run_step(b, b.schedule()[0])
    assert kv.reserved == 2 and kv.allocator.num_free == kv.num_pages


def test_abort_finishes_a_waiting_or_running_request_and_returns_its_pages():
    kv = _pool(6)
    sched = Scheduler(kv, max_batch_size=4, max_batch_tokens=100)
    a, b = _seq(0, 6, 6), _seq(1, 6, 6)  # 3 pages each: the pool holds both
    c = _seq(2, 6, 6)
    for s in (a, b, c):
        sched.add(s)
    batch, _ = sched.schedule()
    assert batch == [a, b] and kv.reserved == 6 and list(sched.waiting) == [c]
    _run_step(sched, batch)
    assert sched.abort(a) and a.status is SeqStatus.FINISHED and a.finish_reason == "abort"
    assert kv.reserved == 3 and not a.pages and sched.running == [b]
    assert sched.abort(c) and c.finish_reason == "abort" and not sched.waiting
    assert not sched.abort(a)  # already finished
    batch, _ = sched.schedule()
    assert batch == [b]  # the aborted ones never run again
