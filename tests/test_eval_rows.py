"""Report rows of `mtp-eval` without running a model: prompt lookup's floor on every drafter's row, the best row,
and the table's columns."""

from __future__ import annotations

from mtp_train.eval.report import markdown_table
from mtp_train.eval.rows import attach_ngram, best_row


def _row(method, k, speedup, tau, dataset="overall", **extra):
    return {"dataset": dataset, "method": method, "k": k, "temperature": 0.0, "speedup": speedup, "tau": tau,
            **extra}


def test_prompt_lookup_figures_join_the_rows_of_the_same_prompts_and_k():
    rows = [_row("head", 2, 1.1, 1.6, draft_threshold=0.0), _row("head", 3, 1.3, 1.9, draft_threshold=0.4),
            _row("ngram", 2, 0.9, 1.2), _row("ngram", 3, 1.0, 1.3), _row("head", 3, 1.0, 1.5, dataset="mt-bench")]
    attach_ngram(rows)
    assert (rows[0]["tau_ngram"], rows[0]["speedup_ngram"]) == (1.2, 0.9)
    assert (rows[1]["tau_ngram"], rows[1]["speedup_ngram"]) == (1.3, 1.0)
    assert "tau_ngram" not in rows[2] and "tau_ngram" not in rows[4]  # no lookup run on mt-bench
    # the best row is the drafter's, never the comparison's, even where lookup is faster
    rows.append(_row("ngram", 5, 2.0, 2.5))
    assert best_row(rows)["method"] == "head" and best_row(rows)["k"] == 3
    assert best_row([r for r in rows if r["method"] == "ngram"])["k"] == 5
    table = markdown_table(rows)
    header = table.splitlines()[0]
    for col in ("draft_threshold", "mean_draft_len", "tau_ngram", "speedup_ngram"):
        assert col in header
    assert "| 0.400 |" in table.splitlines()[3]  # the threshold of the second row
