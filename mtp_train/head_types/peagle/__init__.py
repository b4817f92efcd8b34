"""The `peagle` head type: P-EAGLE (`head.py` `PEagleHead`), EAGLE-3's layer drafting k tokens in ONE
forward; exported natively and in the speculators layout vLLM serves with `parallel_drafting` (`speculators-peagle`).

Its drafter, `ParallelProposer`, runs each step as vLLM's parallel drafting does: one head forward per sequence over
the rows its cache lacks, i.e. the positions the last verification accepted (the whole prompt after prefill), each
reading the target's aux layers there and the token after it, followed by k-1 slots (mask_hidden and the
placeholder token) at the next positions. Causal attention over the head's paged cache gives every row what
vLLM's does: the last accepted row sees the context and drafts d_1, slot d sees the context and slots 1..d and
drafts d_{d+1}. The slots' K/V land beyond the accepted length; the next step's accepted rows overwrite them
before anything reads them. `prefill` and `update` only keep the target's rows for that forward.

A chain of k drafts, cut where a draft's top-1 probability falls under `draft_threshold` (0 = all k).
"""

from __future__ import annotations

from mtp_train.config.head import NORM_FLAGS, HeadType, HeadTypeSpec
from mtp_train.head_types.peagle.drafter import PARALLEL_OPTIONS, parallel_drafter, parallel_inference_path
from mtp_train.head_types.peagle.head import PEagleHead
from mtp_train.head_types.peagle.layouts import LAYOUTS
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
    layouts=LAYOUTS,
)
