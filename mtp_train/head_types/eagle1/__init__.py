"""The `eagle1` head type: the original EAGLE head (`head.py` `Eagle1Head`, the mtp structure with every
norm off), drafting chains and trees (`chain.py`); exported natively and in vLLM's and SGLang's EAGLE-1 layouts."""

from __future__ import annotations

from mtp_train.config.head import NORM_FLAGS, HeadType, HeadTypeSpec
from mtp_train.head_types.chain import CHAIN_OPTIONS, chain_drafter
from mtp_train.head_types.eagle1.head import Eagle1Head
from mtp_train.head_types.eagle1.layouts import TYPE_LAYOUTS
from mtp_train.speculative.chain import inference_chain

HEAD_TYPE = HeadType(
    spec=HeadTypeSpec("eagle1", "the original EAGLE head: the mtp structure with every norm off",
                      dict.fromkeys(NORM_FLAGS, False), inits=("scratch", "last_layer")),
    module=Eagle1Head,
    drafter=chain_drafter,
    inference_path=inference_chain,
    draft_options=CHAIN_OPTIONS,
    layouts=TYPE_LAYOUTS,
)
