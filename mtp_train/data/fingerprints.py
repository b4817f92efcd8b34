"""Fingerprints of a tokenizer (what turns text into ids), and loading a model folder's tokenizer.

A stage records them with its outputs so that a later stage refuses data made with another tokenizer; the chat
template's own fingerprint is `mtp_train.data.chat.chat_template_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mtp_train.models.config import ModelConfigError


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    # The template renders bos/eos by name, so a changed special token changes the training text.
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    return {n: str(getattr(tokenizer, n, None)) for n in names}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) over the vocabulary, merges, added tokens, pipeline and special tokens, stably serialised.

    Runtime settings (truncation, padding) are left out: they do not change how text becomes ids.
    """
    h = hashlib.sha256()
    h.update(json.dumps(_special_tokens(tokenizer), sort_keys=True).encode("utf-8"))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # `to_str` is a fixed-order serialisation: {"version", "truncation", "padding", "added_tokens", ...,
        # "model"}. Parsing the whole of it takes a second for a large vocabulary, so only the small head with the
        # runtime settings is parsed and normalised; the rest is hashed as written.
        text = backend.to_str()
        cut = text.find(',"added_tokens":')
        if text.startswith('{"version"') and cut > 0:
            head = json.loads(text[:cut] + "}")
            tail = text[cut:]
        else:
            head, tail = json.loads(text), ""
        head.pop("truncation", None)
        head.pop("padding", None)
        h.update(json.dumps(head, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        h.update(tail.encode("utf-8"))
    else:  # a slow tokenizer: its vocabulary and added tokens are what we can see
        added = getattr(tokenizer, "added_tokens_decoder", {})
        spec = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
                "added": {str(k): str(v) for k, v in sorted(added.items())}}
        h.update(json.dumps(spec, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()


def load_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer of a model folder, with a clear error when the folder has none."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ModelConfigError(f"{path} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                               f"commands that render chats need the target's tokenizer beside its weights")
    return AutoTokenizer.from_pretrained(str(path))
