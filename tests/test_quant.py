"""fp8 hidden-state storage: the quantiser's error bound, and a precompute folder stored in fp8 that reads back
through the unchanged reader API, dequantised, within that bound of the bf16 folder and in about half its bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtp_train.config import PrecomputeConfig
from mtp_train.models import load_model
from mtp_train.precompute import PrecomputedDataset, precompute
from mtp_train.precompute.quant import FP8, FP8_MAX, dequantize_fp8, quantize_fp8
from tests._precompute_worker import make_samples

AUX = [1, 2]
KW = dict(tokenizer_fingerprint="tok-fp", chat_template_fingerprint="tmpl-fp", data_info={"source": "random"})

pytestmark = pytest.mark.usefixtures("one_thread")


def _bound(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Per element: 2^-4 of |x| (3 mantissa bits, round to nearest) plus e4m3's subnormal step at the row's scale."""
    t, width = x.shape
    amax = x.abs().reshape(t, groups, width // groups).amax(-1, keepdim=True)
    step = (amax / FP8_MAX * 2.0**-9).expand(t, groups, width // groups).reshape(t, width)
    return x.abs() * 2.0**-4 + step


@pytest.mark.parametrize("groups", [1, 3])
def test_quantise_round_trip_is_within_the_fp8_bound(groups):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, groups * 32, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)  # norms over 6 decades
    x[5] = 0.0  # an all-zero token stays zero
    q, scale = quantize_fp8(x, groups)
    assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (64, groups) and scale.dtype == torch.float32
    back = dequantize_fp8(q, scale, torch.float32)
    assert torch.all((back - x).abs() <= _bound(x, groups) * 1.001)
    assert torch.equal(back[5], torch.zeros_like(back[5]))
    # Each token's (and group's) largest magnitude is represented exactly at e4m3's maximum.
    top = x.abs().reshape(64, groups, -1).amax(-1)
    torch.testing.assert_close(back.abs().reshape(64, groups, -1).amax(-1), top, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="multiple"):
        quantize_fp8(torch.zeros(2, 5), groups=2)


@pytest.fixture(scope="module")
def folders(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    model_dir = tiny_checkpoints["llama"][0]
    model = load_model(model_dir, dtype="float32", backend="torch")
    samples = make_samples(24, seed=3)
    out = {}
    for storage in ("bfloat16", "float8_e4m3"):
        d = tmp_path_factory.mktemp(storage)
        precompute(model, samples, PrecomputeConfig(out=str(d), progress=False, val_fraction=0.0, aux_layers=AUX,
                                                    hidden_dtype=storage, shard_tokens=300),
                   model_dir=model_dir, **KW)
        out[storage] = d
    return out


def test_fp8_folder_reads_back_dequantised_through_the_same_api(folders):
    bf16, fp8 = PrecomputedDataset(folders["bfloat16"]), PrecomputedDataset(folders["float8_e4m3"])
    assert fp8.manifest.hidden.dtype == "float8_e4m3fn" and bf16.manifest.hidden.dtype == "bfloat16"
    assert fp8.ids == bf16.ids
    for i in range(len(fp8)):
        a, b = bf16[i], fp8[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key, groups in (("hidden", 1), ("aux_hidden", len(AUX))):
            assert b[key].dtype == torch.bfloat16 and b[key].shape == a[key].shape
            ref = a[key].float()
            # Two roundings to compare against: bf16's of the reference (2^-8) and fp8's, then bf16's of the result.
            err = (b[key].float() - ref).abs()
            assert torch.all(err <= _bound(ref, groups) * 1.02 + ref.abs() * 2.0**-7), key


def test_fp8_bytes_per_token(folders):
    bf16, fp8 = PrecomputedDataset(folders["bfloat16"]), PrecomputedDataset(folders["float8_e4m3"])
    h, k, tokens = bf16.manifest.target.hidden_size, len(AUX), bf16.manifest.totals.tokens
    # Tensor payload per token: ids (4) + mask (1) + (1 + k) · (2H) in bf16, or (1 + k) · (H + 4) in fp8.
    per_token = {name: ds.manifest.totals.bytes / tokens for name, ds in (("bf16", bf16), ("fp8", fp8))}
    assert per_token["fp8"] <= (1 + k) * (h + 4) + 5 + 8  # + headers and offsets, a few bytes per token here
    assert per_token["fp8"] < 0.6 * per_token["bf16"]


def test_unknown_storage_is_refused(tiny_checkpoints, tmp_path):
    model_dir = tiny_checkpoints["llama"][0]
    model = load_model(model_dir, dtype="float32", backend="torch")
    with pytest.raises(ValueError, match="hidden_dtype='int4'.*float8_e4m3"):
        precompute(model, make_samples(2, seed=0), PrecomputeConfig(out=str(tmp_path), hidden_dtype="int4"),
                   model_dir=model_dir, **KW)


def test_a_head_trains_on_an_fp8_folder(folders, tiny_checkpoints, tmp_path):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.train import train_main
    from mtp_train.config import CONF_DIR, register_configs

    register_configs()
    overrides = [f"model.path={tiny_checkpoints['llama'][0]}", "model.device=cpu", "model.backend=torch",
                 f"data.dir={folders['float8_e4m3']}", f"out={tmp_path / 'run'}", "wandb.mode=disabled",
                 "train.progress=false", "train.max_steps=3", "train.micro_batch_tokens=256", "train.eval_batches=0",
                 "spec_eval.prompts=[]", "optim.warmup_steps=1"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    res = train_main(cfg)
    assert res["step"] == 3 and torch.isfinite(torch.tensor(res["train/loss"]))
    from mtp_train.heads import load_head

    head = load_head(res["head_dir"], tiny_checkpoints["llama"][0])  # the exported head loads for this target
    assert all(torch.isfinite(v).all() for v in head.state_dict().values() if v.is_floating_point())
