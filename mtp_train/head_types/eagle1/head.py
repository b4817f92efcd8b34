"""The original EAGLE head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty").

    x = fc [ E(t_{i+1}) ; h_i ]                  (2H → H, embedding first; no bias by default, as vLLM loads it)
    ĥ_{i+1} = DecoderLayer without input_layernorm (post-attention norm and MLP kept), no final norm
    logits = lm_head(ĥ_{i+1})                    (frozen target lm_head)

It is the MTP head with every norm switched off (HeadConfig(type="eagle1") defaults), kept as its own type
because its export layouts differ (vLLM's `llama_eagle.py` refuses a layer-0 input_layernorm key; SGLang's
EAGLE expects an fc bias). Any norm can still be switched back on, one flag at a time, for ablations.
"""

from __future__ import annotations

from mtp_train.head_types.mtp.head import MTPHead


class Eagle1Head(MTPHead):
    """EAGLE-1: the MTP structure with enorm, hnorm, the layer's input norm and the final norm off by default."""

    type_name = "eagle1"
