"""Fingerprints of a tokenizer (what turns text into ids), and loading a model folder's tokenizer.

A stage records them with its outputs so that a later stage refuses data made with another tokenizer; the chat
template's own fingerprint is `mtp_train.data.chat.chat_template_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mtp_train.data.spans import check_template
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


TOKENIZER_JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "chat_template.json")
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "spiece.model")  # what a tokenizer.json can be built from


def _why_not_loaded(path: Path) -> str | None:
    """The file to blame when a model folder's tokenizer cannot be loaded: a JSON file that does not parse, or a
    missing tokenizer.json with nothing to build one from (None when neither is the case)."""
    for name in TOKENIZER_JSON_FILES:
        f = path / name
        if not f.is_file():
            continue
        try:
            json.loads(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            return f"{f}: not UTF-8 text (byte {e.start}); restore the file from the model's repository"
        except json.JSONDecodeError as e:
            return (f"{f}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; restore the file from the "
                    f"model's repository")
    if not (path / "tokenizer.json").is_file() and not any((path / n).is_file() for n in SLOW_TOKENIZER_FILES):
        return (f"{path / 'tokenizer.json'} is missing (and there is no {' / '.join(SLOW_TOKENIZER_FILES)} to build "
                f"it from); copy the target's tokenizer.json beside its weights")
    return None


def load_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer of a model folder, with its chat template checked; an error names the file to
    blame when the folder has none, one of its files is damaged or missing, or the template does not parse."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ModelConfigError(f"{path} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                               f"commands that render chats need the target's tokenizer beside its weights")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types here; the folder's files say which one is to blame
        why = _why_not_loaded(path)
        if why is None:
            raise
        raise ModelConfigError(why) from exc
    if getattr(tokenizer, "chat_template", None) is not None:
        check_template(tokenizer)
    return tokenizer
