"""The `eagle3` head type: EAGLE-3 (`head.py` `Eagle3Head`: aux target layers in, its own lm_head over a
draft vocabulary), drafting chains and trees (`chain.py`); exported natively, in the speculators format (vLLM) and
SGLang's EAGLE-3 layout."""

from __future__ import annotations

from mtp_train.config.head import NORM_FLAGS, HeadType, HeadTypeSpec
from mtp_train.head_types.chain import CHAIN_OPTIONS, chain_drafter
from mtp_train.head_types.eagle3.head import Eagle3Head
from mtp_train.head_types.eagle3.layouts import TYPE_LAYOUTS
from mtp_train.head_types.eagle3.settings import Eagle3Settings
from mtp_train.speculative.chain import inference_chain

HEAD_TYPE = HeadType(
    # enorm = the layer's input_layernorm on the embedding, hnorm = its hidden_norm, final_norm = `norm`.
    spec=HeadTypeSpec("eagle3", "EAGLE-3: aux target layers in, its own lm_head over a draft vocabulary",
                      dict.fromkeys(NORM_FLAGS, True), fixed_norms=NORM_FLAGS, features="aux", fixed_features=True,
                      draft_vocab_required=True, settings=Eagle3Settings),
    module=Eagle3Head,
    drafter=chain_drafter,
    inference_path=inference_chain,
    draft_options=CHAIN_OPTIONS,
    layouts=TYPE_LAYOUTS,
    foreign_targets=True,
)
