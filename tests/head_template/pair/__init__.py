"""The `pair` head type, a template: two drafts from ONE forward of a small MLP over [E(t_{i+1}) ; h_i] (no chain,
no KV cache), with one setting of its own (`head.mlp_ratio`), its drafter and an export layout of its own.

Everything of the type is in this folder; the head-type registry finds it by scanning `mtp_train/head_types/`, and
Hydra finds its `head=pair` option in `conf.yaml` (tests/head_template/README.md).
"""

from __future__ import annotations

from mtp_train.config.head import NORM_FLAGS, HeadType, HeadTypeSpec

from .drafter import pair_drafter, pair_inference_path
from .head import PairHead
from .layouts import TYPE_LAYOUTS
from .settings import PairSettings

HEAD_TYPE = HeadType(
    spec=HeadTypeSpec("pair", "two drafts from one forward of an MLP", dict.fromkeys(NORM_FLAGS, False),
                      fixed_norms=NORM_FLAGS, settings=PairSettings),
    module=PairHead,
    drafter=pair_drafter,
    inference_path=pair_inference_path,
    layouts=TYPE_LAYOUTS,
)
