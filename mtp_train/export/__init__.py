"""Head exports for serving engines: native, vLLM/SGLang EAGLE-1 and EAGLE-3 (speculators), DeepSeek-V3 MTP and
Qwen3-Next MTP layouts."""

from mtp_train.export.exporter import (
    check_fits,
    describe,
    export_head,
    layout_tensors,
    load_export,
    verify_round_trip,
)
from mtp_train.export.layouts import FORMATS, LAYOUTS, LayoutError

__all__ = ["FORMATS", "LAYOUTS", "LayoutError", "check_fits", "describe", "export_head", "layout_tensors",
           "load_export", "verify_round_trip"]
