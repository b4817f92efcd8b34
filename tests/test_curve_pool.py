"""bench/curve/pool.py: the long curve's prompt pool (ids unique, no held-out prompt, the demo's prompts whole)."""

from __future__ import annotations

import pytest

from bench.curve import pool


def test_repeated_ids_get_a_suffix_and_the_first_keeps_its_own():
    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"},
            {"id": "a", "prompt": "w"}]
    assert [r["id"] for r in pool.unique_ids(rows)] == ["a", "b", "a#2", "a#3"]


def test_the_pool_holds_the_demo_prompts_and_no_held_out_one():
    if not pool.SHARED.is_dir():
        pytest.skip(f"{pool.SHARED} is not here (the shared prompt pool)")
    rows = pool.build(chat=64, code=32, seed=0, max_chars=1500)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 960 + 64 + 32
    assert not {r["prompt"].strip() for r in rows} & pool.heldout_texts()
    assert all(len(r["prompt"]) <= 1500 for r in rows if r["source"].startswith("mix_"))
    assert [r["id"] for r in pool.build(chat=64, code=32, seed=0, max_chars=1500)] == ids  # seeded
