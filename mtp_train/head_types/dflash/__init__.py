"""The `dflash` head type: a block drafter (`head.py` `DFlashHead`) drafting up to B-1 tokens with ONE forward per
step (`drafter.py` `BlockProposer`), its settings (`settings.py`), exported natively and in the z-lab and speculators
DFlash layouts vLLM serves (`layouts.py`)."""

from __future__ import annotations

from mtp_train.config.head import NORM_FLAGS, HeadType, HeadTypeSpec
from mtp_train.head_types.dflash.drafter import BLOCK_OPTIONS, block_drafter, block_inference_path
from mtp_train.head_types.dflash.head import DFlashHead, default_block_layers
from mtp_train.head_types.dflash.layouts import TYPE_LAYOUTS
from mtp_train.head_types.dflash.settings import BlockSettings

HEAD_TYPE = HeadType(
    spec=HeadTypeSpec("dflash", "DFlash: a block of B-1 drafts from one forward over the target's aux layers",
                      dict.fromkeys(NORM_FLAGS, True), fixed_norms=NORM_FLAGS, features="aux", fixed_features=True,
                      block=True, aux_default=default_block_layers,
                      settings=BlockSettings),
    module=DFlashHead,
    drafter=block_drafter,
    inference_path=block_inference_path,
    draft_options=BLOCK_OPTIONS,
    layouts=TYPE_LAYOUTS,
)
