"""`/metrics`: the server's counters in Prometheus' text format (version 0.0.4), written out by hand: a few
counters and gauges need no client library."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "mtp_serve_"
NO_ENDPOINT = "none"  # the endpoint label of a request that ended before its request line and headers were read


@dataclass
class RequestCounters:
    """Requests answered, by endpoint and HTTP status (kept by the app's handlers and the connections' layer, all on
    the event loop's thread)."""

    by_status: Counter[tuple[str, int]] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    preparing: int = 0  # requests being rendered or tokenized (on worker threads) right now

    def count(self, endpoint: str, status: int) -> None:
        self.by_status[(endpoint, status)] += 1


def _line(name: str, value: float, labels: dict[str, Any] | None = None) -> str:
    lab = ""
    if labels:
        lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    return f"{PREFIX}{name}{lab} {value:g}" if isinstance(value, float) else f"{PREFIX}{name}{lab} {value}"


def render_metrics(model_id: str, requests: RequestCounters, worker: dict[str, Any], engine_stats: Any) -> str:
    """The exposition text: requests by endpoint and status, tokens, the engine's steps and batch, and with a head
    its drafted and accepted tokens, acceptance rate and mean acceptance length (τ).

    Args:
        model_id: the served model id (a label on every sample).
        requests: the handlers' counters.
        worker: `EngineWorker.describe()`.
        engine_stats: the engine's `GenerationStats` (a `SpecStats` when a head drafts).
    """
    m = {"model": model_id}
    out: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[float, dict[str, Any]]]) -> None:
        out.append(f"# HELP {PREFIX}{name} {doc}")
        out.append(f"# TYPE {PREFIX}{name} {kind}")
        out.extend(_line(name, v, {**m, **lab}) for v, lab in samples)

    metric("requests_total", "counter", "HTTP requests answered, by endpoint and status (endpoint none: ended by "
           "the server before its headers were whole).",
           [(n, {"endpoint": e, "status": s}) for (e, s), n in sorted(requests.by_status.items())])
    metric("prompt_tokens_total", "counter", "Prompt tokens of answered requests.", [(requests.prompt_tokens, {})])
    metric("generation_tokens_total", "counter", "Tokens generated for answered requests.",
           [(requests.completion_tokens, {})])
    metric("requests_preparing", "gauge", "Requests being rendered or tokenized.", [(requests.preparing, {})])
    metric("requests_running", "gauge", "Requests in the engine.", [(worker["running"], {})])
    metric("requests_waiting", "gauge", "Requests submitted, not yet taken by the engine.", [(worker["waiting"], {})])
    metric("engine_steps_total", "counter", "Engine steps (forwards of the target).", [(worker["steps"], {})])
    metric("engine_batched_sequences_total", "counter", "Sequences advanced, summed over the steps.",
           [(worker["batched"], {})])
    metric("engine_max_batch", "gauge", "The largest batch of one step so far.", [(worker["max_batch"], {})])
    metric("requests_aborted_total", "counter", "Requests finished early (client gone, stop string).",
           [(worker["aborted"], {})])
    spec = getattr(engine_stats, "metrics", None)
    if spec is not None:
        metric("spec_verify_steps_total", "counter", "Speculative steps (draft, then verify by the target).",
               [(spec.num_drafts, {})])
        metric("spec_draft_tokens_total", "counter", "Draft tokens verified.", [(spec.num_draft_tokens, {})])
        metric("spec_accepted_tokens_total", "counter", "Draft tokens accepted.", [(spec.num_accepted, {})])
        metric("spec_acceptance_rate", "gauge", "Accepted over verified draft tokens.",
               [(float(spec.acceptance_rate), {})])
        metric("spec_mean_acceptance_length", "gauge", "Tokens per verify step (tau): 1 + accepted per step.",
               [(float(spec.mean_acceptance_length), {})])
    return "\n".join(out) + "\n"
