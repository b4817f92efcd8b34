"""The eagle3 head type's serving layouts: speculators (what vLLM loads as `method=eagle3`) and SGLang's EAGLE-3,
built from the pure maps of `export.py` (their names, facts and checks are documented there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mtp_train.export.layouts import Layout
from mtp_train.head_types.eagle3 import export as eagle3
from mtp_train.heads.base import DraftHead


def on_spec(fn: Callable[[Any, eagle3.Eagle3Spec], Any]) -> Callable[[Any, DraftHead], Any]:
    """A function of (x, Eagle3Spec) as one of (x, head)."""
    return lambda x, head: fn(x, eagle3.Eagle3Spec.of(head))


def eagle3_layout(name: str, check: Callable[[eagle3.Eagle3Spec], list[str]], to: Callable[..., Any],
                  frm: Callable[..., Any], config: Callable[..., dict[str, Any]],
                  serves: dict[str, dict[str, Any]]) -> Layout:
    """A layout of maps over an `Eagle3Spec` (it keeps the draft vocabulary, as d2t / t2d)."""
    return Layout(name, lambda head: check(eagle3.Eagle3Spec.of(head)), on_spec(to), on_spec(frm),
                  lambda head, target: config(eagle3.Eagle3Spec.of(head), target), keeps_draft_vocab=True,
                  serves=serves)


TYPE_LAYOUTS = (
    eagle3_layout("speculators", eagle3.speculators_problems, eagle3.to_speculators, eagle3.from_speculators,
                  eagle3.speculators_config, serves={"vllm": {"method": "eagle3"}}),
    eagle3_layout("sglang-eagle3", eagle3.sglang_problems, eagle3.to_sglang, eagle3.from_sglang,
                  eagle3.sglang_config, serves={"sglang": {"speculative_algorithm": "EAGLE3"}}),
)
