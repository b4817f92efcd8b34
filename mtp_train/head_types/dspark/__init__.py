"""The `dspark` head type: DFlash's block drafter with DSpark's Markov head (`head.py` `DSparkHead`),
exported natively and in the layout vLLM serves as `method=dspark` (`qwen3_dspark.py`, `Qwen3DSparkModel`).

Its drafter, `MarkovBlockProposer`, is DFlash's `BlockProposer` (the same paged context cache, prefill and update)
with vLLM's DSpark sampling: ONE block forward per step gives B slot outputs, then the drafts are picked left to
right, draft j from lm_head(slot j) + W2·W1[x_{j-1}] where x_{-1} is the block's first token (the last token of the
sequence) and x_{j-1} the draft picked before (argmax when greedy, a sample from that distribution otherwise, which
is the q the acceptance test reads). A chain of min(k, B) drafts; no trees (a slot's distribution depends on the
token picked before it, so the slots' top-k do not make a tree of the block's distributions).

Dynamic length, `draft_threshold` > 0: with a confidence head, the chain stops before the first draft whose
survival, the running product of the confidence head's estimates up to it (vLLM's adaptive verification scores a
draft slot the same way), falls under the threshold; without one, before the first draft whose top-1 probability
does (as dflash). draft_threshold = 0 verifies the whole chain (vLLM without `enable_adaptive_verification`).
"""

from __future__ import annotations

from mtp_train.config.head import NORM_FLAGS, HeadType, HeadTypeSpec
from mtp_train.head_types.dflash.head import default_block_layers
from mtp_train.head_types.dspark.drafter import MARKOV_OPTIONS, markov_drafter, markov_inference_path
from mtp_train.head_types.dspark.head import DSparkHead
from mtp_train.head_types.dspark.layouts import LAYOUTS
from mtp_train.head_types.dspark.settings import DSparkSettings

HEAD_TYPE = HeadType(
    spec=HeadTypeSpec("dspark", "DSpark: DFlash's block drafting B tokens left to right through a low-rank Markov "
                                "head, with an optional confidence head",
                      dict.fromkeys(NORM_FLAGS, True), fixed_norms=NORM_FLAGS, features="aux", fixed_features=True,
                      block=True, aux_default=default_block_layers,
                      settings=DSparkSettings),
    module=DSparkHead,
    drafter=markov_drafter,
    inference_path=markov_inference_path,
    draft_options=MARKOV_OPTIONS,
    layouts=LAYOUTS,
)
