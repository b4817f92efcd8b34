"""EAGLE-3's own settings (`head.<key>` beside the shared ones). Imports only the config floor (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from mtp_train.config.head import HeadSettings


@dataclass
class Eagle3Settings(HeadSettings):
    """EAGLE-3 feeds the next draft step its output BEFORE the final norm (as vLLM and SGLang run it)."""

    # EAGLE-3.1 (speculators' `norm_output`): the next draft step reads the final-normed output instead.
    norm_output: bool = False
