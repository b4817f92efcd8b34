"""Speculative decoding over the engine: draft trees, their acceptance rules and the metrics that describe them."""

from mtp_train.speculative.acceptance import AcceptResult, accept_greedy, accept_stochastic
from mtp_train.speculative.metrics import SpecMetrics
from mtp_train.speculative.tree import Accepted, DraftTree, VerifyRows

__all__ = ["AcceptResult", "Accepted", "DraftTree", "SpecMetrics", "VerifyRows", "accept_greedy",
           "accept_stochastic"]
