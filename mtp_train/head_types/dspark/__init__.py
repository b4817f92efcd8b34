"""The `dspark` head type: DFlash's block drafter with DSpark's Markov head (`head.py` `DSparkHead`), drafting B
tokens left to right per forward (`drafter.py` `MarkovBlockProposer`), exported natively and in the layout vLLM
serves as `method=dspark` (`layouts.py`)."""

from __future__ import annotations

from mtp_train.config.head import NORM_FLAGS, HeadType, HeadTypeSpec
from mtp_train.head_types.dflash.head import default_block_layers
from mtp_train.head_types.dspark.drafter import MARKOV_OPTIONS, markov_drafter, markov_inference_path
from mtp_train.head_types.dspark.head import DSparkHead
from mtp_train.head_types.dspark.layouts import TYPE_LAYOUTS
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
    layouts=TYPE_LAYOUTS,
)
