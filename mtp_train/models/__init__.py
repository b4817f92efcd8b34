"""Target models: the shared `CausalLM`, one module per family (`families/`), their weight loading and fingerprint."""

from mtp_train.models.base import CausalLM, ForwardOutput
from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.families import args_from_dir, args_from_hf_config
from mtp_train.models.loader import load_model, resolve_dtype

__all__ = ["CausalLM", "ForwardOutput", "ModelArgs", "ModelConfigError", "args_from_dir", "args_from_hf_config",
           "load_model", "resolve_dtype"]
