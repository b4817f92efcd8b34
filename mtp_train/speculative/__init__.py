"""Speculative decoding over the engine: acceptance rules and the metrics that describe them."""

from mtp_train.speculative.acceptance import AcceptResult, accept_greedy, accept_stochastic
from mtp_train.speculative.metrics import SpecMetrics

__all__ = ["AcceptResult", "SpecMetrics", "accept_greedy", "accept_stochastic"]
