"""The `peagle` head type: P-EAGLE (`head.py` `PEagleHead`), EAGLE-3's layer drafting k tokens in ONE forward
(`drafter.py` `ParallelProposer`); exported natively and in the speculators layout vLLM serves with
`parallel_drafting` (`layouts.py`)."""

from __future__ import annotations

from mtp_train.config.head import NORM_FLAGS, HeadType, HeadTypeSpec
from mtp_train.head_types.peagle.drafter import PARALLEL_OPTIONS, parallel_drafter, parallel_inference_path
from mtp_train.head_types.peagle.head import PEagleHead
from mtp_train.head_types.peagle.layouts import TYPE_LAYOUTS
from mtp_train.head_types.peagle.settings import PEagleSettings

HEAD_TYPE = HeadType(
    # enorm = the layer's input_layernorm on the embedding, hnorm = its hidden_norm, final_norm = `norm` (eagle3's).
    spec=HeadTypeSpec("peagle", "P-EAGLE: EAGLE-3's layer drafting k tokens in one forward from a learned placeholder",
                      dict.fromkeys(NORM_FLAGS, True), fixed_norms=NORM_FLAGS, features="aux", fixed_features=True,
                      draft_vocab_required=True, settings=PEagleSettings),
    module=PEagleHead,
    drafter=parallel_drafter,
    inference_path=parallel_inference_path,
    draft_options=PARALLEL_OPTIONS,
    layouts=TYPE_LAYOUTS,
)
