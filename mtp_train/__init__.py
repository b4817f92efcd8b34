"""mtp_train: train speculative-decoding draft heads and prove them on a real speculative inference path."""

__version__ = "0.1.0"
