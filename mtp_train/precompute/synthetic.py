"""Synthetic precompute folders of any size, for tests and benchmarks of the reading side (no target runs).

`make_folder` writes real shards, `token_counts.safetensors` and a real manifest through precompute's own code
(`shard_plan`, `new_shard_tensors` / `store_rows`, `write_shard`, `count_samples`, `write_token_counts`,
`folder_manifest`, `Manifest.save`), so a reader sees exactly what `mtp-precompute` would have written for such
samples; only the tokens and hidden states are random. It works shard by shard, so making a folder of 10^6
samples holds one shard's rows at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import mtp_train
from mtp_train.data.samples import Row
from mtp_train.precompute.manifest import (
    HiddenInfo,
    Manifest,
    ShardInfo,
    TargetInfo,
    write_token_counts,
)
from mtp_train.precompute.plan import plan_runs, shard_plan
from mtp_train.precompute.shards import count_samples, write_shard
from mtp_train.precompute.writer import (
    STORAGE_DTYPES,
    FolderSpec,
    dtype_name,
    folder_manifest,
    folder_spec,
    new_shard_tensors,
    store_rows,
)

SYNTHETIC_FINGERPRINT = "synthetic"  # the tokenizer / template fingerprints (and the target's, without `target`)


def _spec(target: Path | None, hidden_size: int, num_layers: int, vocab_size: int, aux_layers: Sequence[int],
          storage: str) -> FolderSpec:
    """The folder's spec: `target`'s own (config and weights fingerprint) when given, else a made-up target."""
    if target is not None:
        from mtp_train.models.families import args_from_dir

        return folder_spec(args_from_dir(target), torch.float32, target, storage, aux_layers)
    info = TargetInfo(path="synthetic", fingerprint=SYNTHETIC_FINGERPRINT, model_type="llama", hidden_size=hidden_size,
                      num_layers=num_layers, vocab_size=vocab_size, dtype="float32")
    hidden = HiddenInfo(kind="final_norm", dtype=dtype_name(STORAGE_DTYPES[storage]),
                        aux_layers=[int(j) for j in aux_layers])
    return FolderSpec(info, hidden, storage)


def make_folder(out: Path, samples: int, *, target: Path | None = None, hidden_size: int = 16, num_layers: int = 4,
                vocab_size: int = 256, aux_layers: Sequence[int] = (), min_len: int = 4, max_len: int = 12,
                loss_fraction: float = 0.7, shard_tokens: int = 65536, val_fraction: float = 0.05, seed: int = 0,
                storage: str = "bfloat16", token_counts: bool = True) -> Manifest:
    """Write a finished precompute folder of `samples` random samples to `out`; returns its manifest.

    Sample i has id `s{i:08d}`, a length drawn uniformly from min_len..max_len, token ids skewed towards low ids
    (id = vocab_size · u³ for u uniform, so a draft vocabulary has frequent tokens to pick) and a loss mask that is
    1 on about `loss_fraction` of its tokens; hidden states (and aux_hidden) are standard normal, stored in
    `storage`. Everything is a function of the arguments: the same call writes the same bytes.

    Args:
        out: the folder to write (created; shards and manifest.json, no config.yaml).
        samples: number of samples N.
        target: a target model folder: its config gives hidden_size, num_layers and vocab_size, and its weights'
            fingerprint goes into the manifest (so `mtp-train model.path=target` accepts the folder). None: the
            three sizes below, fingerprint "synthetic".
        hidden_size: H of `hidden` (T, H), without `target`.
        num_layers: the target's layer count recorded (aux layers must lie in 0..num_layers), without `target`.
        vocab_size: token ids are in 0..vocab_size-1, without `target`.
        aux_layers: layers stored in `aux_hidden` (T, k·H); () = no aux_hidden.
        min_len: shortest sample, in tokens (>= 1).
        max_len: longest sample, in tokens.
        loss_fraction: probability of each token being under the loss mask.
        shard_tokens: most tokens per shard (precompute's `shard_tokens`).
        val_fraction: the split's val fraction (precompute's rule on ids, with `seed`).
        seed: the random draws and the split's seed.
        storage: the hidden states' storage dtype (a `hidden_dtype` of precompute: bfloat16, float16, float32,
            float8_e4m3).
        token_counts: write `token_counts.safetensors` (and name it in the manifest); False makes a folder as a
            precompute from before that file wrote it.
    """
    if samples < 1 or not 1 <= min_len <= max_len:
        raise ValueError(f"need samples >= 1 and 1 <= min_len <= max_len, got {samples}, {min_len}, {max_len}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = _spec(target, hidden_size, num_layers, vocab_size, aux_layers, storage)
    h, k, vocab = spec.target.hidden_size, len(spec.hidden.aux_layers), spec.target.vocab_size
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, samples)  # (N,)
    width = len(f"{samples - 1}")
    ids = [f"s{i:0{max(8, width)}d}" for i in range(samples)]
    shards: list[ShardInfo] = []
    counts: dict[str, int] = {}
    masked = {s: torch.zeros(vocab, dtype=torch.long) for s in ("train", "val")}  # (V,) loss-masked token counts
    for index, run in enumerate(plan_runs(lengths.tolist(), shard_tokens)):
        n = lengths[run.start:run.stop]
        t = int(n.sum())
        tokens = (vocab * rng.random(t) ** 3).astype(np.int32).clip(0, vocab - 1)  # (T,) skewed to low ids
        mask = (rng.random(t) < loss_fraction).astype(np.uint8)  # (T,)
        cuts = np.concatenate([[0], np.cumsum(n)])
        rows = [Row(ids[run.start + j], tokens[cuts[j]:cuts[j + 1]], mask[cuts[j]:cuts[j + 1]])
                for j in range(len(n))]
        plan = shard_plan(0, index, rows, spec.settings)
        tensors = new_shard_tensors(plan, h, k, storage)
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        store_rows(tensors, 0, t, torch.randn(t, h, generator=g),
                   torch.randn(t, k * h, generator=g) if k else None, storage)
        shards.append(write_shard(out, plan, tensors, spec.metadata))
        shard_counts = count_samples(((r.id, r.ids, r.mask) for r in rows), seed, val_fraction)  # precompute's own
        for key, v in shard_counts.split.items():
            counts[key] = counts.get(key, 0) + v
        if token_counts:
            shard_counts.add_to(masked)
    settings = {"samples": samples, "min_len": min_len, "max_len": max_len, "loss_fraction": loss_fraction,
                "shard_tokens": shard_tokens, "seed": seed, "storage": storage}
    manifest = folder_manifest(
        shards, spec, counts, write_token_counts(out, masked["train"], masked["val"]) if token_counts else None,
        tokenizer_fingerprint=SYNTHETIC_FINGERPRINT, chat_template_fingerprint=SYNTHETIC_FINGERPRINT,
        data_info={"name": "synthetic", "samples": samples}, val_fraction=val_fraction, seed=seed,
        provenance={"version": mtp_train.__version__, "synthetic": settings})
    manifest.save(out)
    return manifest
