"""Target model implementations (one file per family) and their weight loading."""

from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.llama import ForwardOutput, LlamaForCausalLM
from mtp_train.models.loader import load_model, resolve_dtype

__all__ = ["ForwardOutput", "LlamaForCausalLM", "ModelArgs", "ModelConfigError", "load_model", "resolve_dtype"]
