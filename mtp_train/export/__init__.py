"""Head exports for serving engines: native and the layouts each head type brings (`layouts.LAYOUTS`, filled from
`HeadType.layouts`: vLLM/SGLang EAGLE-1 and EAGLE-3, DeepSeek-V3 and Qwen3-Next MTP, DFlash, DSpark, P-EAGLE); a
DeepSeek-V3 MTP head stitched back into its target's checkpoint (`stitch`); a drafter trained elsewhere read into
our head (`importer`, through a layout's reader)."""

from mtp_train.export.exporter import (
    check_fits,
    describe,
    export_head,
    layout_tensors,
    load_export,
    verify_round_trip,
)
from mtp_train.export.layouts import LAYOUTS, LayoutError, export_formats, import_layouts, unmatched_formats
from mtp_train.export.stitch import STITCH_FORMATS, StitchResult, stitch, stitch_head, verify_stitched

__all__ = ["LAYOUTS", "STITCH_FORMATS", "LayoutError", "StitchResult", "check_fits", "describe",
           "export_formats", "export_head", "import_layouts", "layout_tensors", "load_export", "stitch", "stitch_head",
           "unmatched_formats", "verify_round_trip", "verify_stitched"]
