"""What every record carries about how it was made, and which of it must match when a run resumes."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from mtp_train import __version__
from mtp_train.config import RegenerateConfig
from mtp_train.data.chat import chat_template_fingerprint, tokenizer_fingerprint

PROVENANCE_VOLATILE = ("created_at", "package_version", "target.path", "target.name")  # may differ on resume


def make_provenance(*, target: Mapping[str, Any], tokenizer: Any, cfg: RegenerateConfig,
                    stop_ids: Sequence[int]) -> dict[str, Any]:
    """The provenance of a run's records: the generator's own (`Generator.provenance`, as `target`: for our engine
    the target's name, path and weights fingerprint), tokenizer and chat template fingerprints,
    `cfg.chat_template_kwargs`, `cfg.sampling()` and the stop ids."""
    return {
        "target": dict(target),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "chat_template_fingerprint": chat_template_fingerprint(tokenizer),
        "chat_template_kwargs": dict(cfg.chat_template_kwargs),
        "sampling": cfg.sampling(),
        "stop_token_ids": [int(i) for i in stop_ids],
        "package_version": __version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys: {"a": {"b": 1}} → {"a.b": 1} (empty mappings stay values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def provenance_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """`key: old != new` for every provenance entry that must match on resume (times and paths may differ)."""
    a, b = flatten(old), flatten(new)
    keys = sorted((set(a) | set(b)) - set(PROVENANCE_VOLATILE))
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
