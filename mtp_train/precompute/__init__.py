"""Stage one: target hidden states precomputed into checksummed shards with a manifest, and their reader.

The public surface: `precompute` (what `mtp-precompute` runs), the one folder writer (`FolderWriter` over
`plan_shards` with a `folder_spec`) that hybrid training writes its folder with too, the manifest and the
reader.
"""

from mtp_train.data.samples import Sample
from mtp_train.precompute.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    HiddenInfo,
    Manifest,
    ManifestError,
    ManifestMismatchError,
    ShardInfo,
    SplitInfo,
    TargetInfo,
    TokenizerInfo,
    Totals,
    in_split,
    is_val,
)
from mtp_train.precompute.pipeline import precompute
from mtp_train.precompute.plan import ShardPlan, plan_runs, plan_shards
from mtp_train.precompute.reader import (
    CorruptShardError,
    FolderIndex,
    MissingShardError,
    PrecomputedDataset,
    ReadCounts,
    ShardError,
)
from mtp_train.precompute.writer import (
    FolderSpec,
    FolderWriter,
    PrecomputeError,
    as_stored,
    check_settings,
    folder_complete,
    folder_spec,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CorruptShardError",
    "FolderSpec",
    "FolderIndex",
    "FolderWriter",
    "HiddenInfo",
    "Manifest",
    "ManifestError",
    "ManifestMismatchError",
    "MissingShardError",
    "PrecomputeError",
    "PrecomputedDataset",
    "ReadCounts",
    "Sample",
    "ShardError",
    "ShardInfo",
    "ShardPlan",
    "SplitInfo",
    "TargetInfo",
    "TokenizerInfo",
    "Totals",
    "as_stored",
    "check_settings",
    "folder_complete",
    "folder_spec",
    "in_split",
    "is_val",
    "plan_runs",
    "plan_shards",
    "precompute",
]
