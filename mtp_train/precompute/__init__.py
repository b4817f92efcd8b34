"""Stage one: target hidden states precomputed into checksummed shards with a manifest, and their reader."""

from mtp_train.precompute.manifest import (
    FORMAT_VERSION,
    HiddenInfo,
    Manifest,
    ManifestError,
    ManifestMismatchError,
    ShardInfo,
    SplitInfo,
    TargetInfo,
    TokenizerInfo,
    Totals,
    is_val,
)
from mtp_train.precompute.plan import Sample
from mtp_train.precompute.reader import (
    CorruptShardError,
    LengthBucketedBatchSampler,
    MissingShardError,
    PrecomputedDataset,
    ShardError,
)
from mtp_train.precompute.writer import PrecomputeError, precompute

__all__ = [
    "FORMAT_VERSION",
    "CorruptShardError",
    "HiddenInfo",
    "LengthBucketedBatchSampler",
    "Manifest",
    "ManifestError",
    "ManifestMismatchError",
    "MissingShardError",
    "PrecomputeError",
    "PrecomputedDataset",
    "Sample",
    "ShardError",
    "ShardInfo",
    "SplitInfo",
    "TargetInfo",
    "TokenizerInfo",
    "Totals",
    "is_val",
    "precompute",
]
