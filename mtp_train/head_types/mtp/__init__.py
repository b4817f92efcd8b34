"""The `mtp` head type: the RMSNorm-restored head in the DeepSeek-V3 MTP shape (`head.py` `MTPHead`),
drafting chains and trees (`chain.py`); exported natively and in the DeepSeek-V3 and Qwen3-Next MTP layouts."""

from __future__ import annotations

from mtp_train.config.head import INITS, NORM_FLAGS, HeadType, HeadTypeSpec
from mtp_train.head_types.chain import CHAIN_OPTIONS, chain_drafter
from mtp_train.head_types.mtp.head import MTPHead
from mtp_train.head_types.mtp.layouts import TYPE_LAYOUTS
from mtp_train.speculative.chain import inference_chain

HEAD_TYPE = HeadType(
    # target_mtp: the checkpoint's MTP layer is this type's shape exactly (see `config.head.target_mtp_problems`)
    spec=HeadTypeSpec("mtp", "RMSNorm-restored, DeepSeek-V3 MTP shape", dict.fromkeys(NORM_FLAGS, True),
                      inits=INITS),
    module=MTPHead,
    drafter=chain_drafter,
    inference_path=inference_chain,
    draft_options=CHAIN_OPTIONS,
    layouts=TYPE_LAYOUTS,
)
