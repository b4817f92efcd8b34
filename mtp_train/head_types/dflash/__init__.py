"""The `dflash` head type: a block drafter (`head.py` `DFlashHead`) that drafts up to B-1 tokens with
ONE forward per step, exported natively and in the z-lab DFlash layout vLLM serves (`method=dflash`).

Its drafter, `BlockProposer`, keeps the head's context K/V in its own paged pool (one layer per draft layer, the
target's page ids): `prefill` writes the prompt's positions from the target's aux layers, `update` the accepted
positions after each verify, so the pool grows with accepted tokens only. `propose` runs the block
[t_{L-1}, mask × (B-1)] at positions L-1..L+B-2 over the context 0..L-2 and returns a chain of min(k, B-1) drafts
(each slot's own distribution: the slots are drafted in parallel), cut where a slot's top-1 probability falls
under `draft_threshold`; or, with `tree` (greedy sequences), a tree from the slots' top-k (`block_tree`).
"""

from __future__ import annotations

from mtp_train.config.head import NORM_FLAGS, HeadType, HeadTypeSpec
from mtp_train.head_types.dflash.drafter import BLOCK_OPTIONS, block_drafter, block_inference_path
from mtp_train.head_types.dflash.head import DFlashHead, default_block_layers
from mtp_train.head_types.dflash.layouts import LAYOUTS
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
    layouts=LAYOUTS,
)
