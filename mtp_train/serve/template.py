"""The chat template variables a head was trained with, and the ones `mtp-serve` renders chat requests with.

A head drafts well after the prompts it was trained on: a server that renders with other `chat_template_kwargs`
(Qwen3's `enable_thinking`, say: an empty think block in every prompt or none) feeds it prompts it never saw, and
acceptance falls. A head records where its samples came from (`config.json`'s "extra": an online or hybrid run's
`data_online` settings, an offline run's precompute folder `data_dir`, whose manifest keeps the command's config),
so the server takes the head's kwargs when none are set, and warns when the ones set differ.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mtp_train.heads.checkpoint import read_head_config

log = logging.getLogger(__name__)


def _kwargs_at(d: Any, *keys: str) -> dict[str, Any] | None:
    """d[k0][k1]... when every step is a mapping and the last one is too, else None."""
    for k in keys:
        if not isinstance(d, Mapping):
            return None
        d = d.get(k)
    return dict(d) if isinstance(d, Mapping) else None


def trained_template_kwargs(head_dir: str | Path) -> dict[str, Any] | None:
    """The `chat_template_kwargs` the head's training samples were rendered with, or None when it does not say
    (a head of an older version, a precompute folder no longer there)."""
    extra = read_head_config(head_dir).get("extra") or {}
    online = _kwargs_at(extra, "data_online", "chat_template_kwargs")
    if online is not None:
        return online
    data_dir = extra.get("data_dir")
    manifest = Path(str(data_dir)) / "manifest.json" if data_dir else None
    if manifest is None or not manifest.is_file():
        return None
    try:
        config = (json.loads(manifest.read_text(encoding="utf-8")).get("provenance") or {}).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    # mtp-precompute records its own config; a hybrid run's folder, the training config
    return _kwargs_at(config, "chat_template_kwargs") or _kwargs_at(config, "data", "online", "chat_template_kwargs")


def served_template_kwargs(head_dir: str | Path | None, asked: Mapping[str, Any]) -> dict[str, Any]:
    """The kwargs a server renders chat requests with: `asked` (the `chat_template_kwargs` setting) when set, else
    those the head was trained with; a warning when the two differ (the prompts are not the trained ones)."""
    asked = dict(asked)
    trained = trained_template_kwargs(head_dir) if head_dir else None
    if trained is None:
        return asked
    if not asked and trained:
        log.info("rendering chat requests with chat_template_kwargs=%s, as the head %s was trained", trained, head_dir)
        return trained
    if asked != trained:
        log.warning("the head %s was trained on conversations rendered with chat_template_kwargs=%s, this server "
                    "renders with %s: its prompts differ from the trained ones and fewer drafts will be accepted; "
                    "set chat_template_kwargs to the trained ones", head_dir, trained, asked)
    return asked
