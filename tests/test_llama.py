"""Parity of our Llama-family target with `transformers` on tiny random configs of every family."""

from __future__ import annotations

import pytest
import torch

from mtp_train.engine import prefill_hidden
from mtp_train.layers import AttentionMetadata
from mtp_train.models import load_model
from tests.conftest import TINY_CONFIGS


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_logits_and_hidden_states_match_transformers(tiny_checkpoints, name):
    path, hf = tiny_checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    n_layers = model.args.num_layers
    torch.manual_seed(1)
    ids = torch.randint(0, model.args.vocab_size, (48,))  # longer than mistral's window of 16
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
    meta = AttentionMetadata.build([ids.numel()])
    out = model(ids, meta, logits_indices=torch.arange(ids.numel()), hidden_layers=range(n_layers + 1))
    torch.testing.assert_close(out.logits, ref.logits[0], rtol=1e-5, atol=1e-5)
    for j in range(n_layers + 1):
        torch.testing.assert_close(out.layers[j], ref.hidden_states[j][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_logits_only_at_requested_positions(tiny_checkpoints, name):
    path, hf = tiny_checkpoints[name]
    model = load_model(path, dtype="float32", backend="torch")
    ids = torch.randint(0, model.args.vocab_size, (20,))
    meta = AttentionMetadata.build([20])
    idx = torch.tensor([3, 19])
    out = model(ids, meta, logits_indices=idx)
    assert out.logits.shape == (2, model.args.vocab_size)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, idx]
    torch.testing.assert_close(out.logits, ref, rtol=1e-5, atol=1e-5)
    assert model(ids, AttentionMetadata.build([20])).logits is None


def test_tied_embeddings_share_storage(tiny_checkpoints):
    model = load_model(tiny_checkpoints["llama-tied"][0], dtype="float32")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    untied = load_model(tiny_checkpoints["llama"][0], dtype="float32")
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_transformers(tiny_checkpoints, dtype):
    path, hf = tiny_checkpoints["llama"]
    model = load_model(path, dtype=dtype)
    assert model.dtype == dtype
    ids = torch.randint(0, model.args.vocab_size, (24,))
    hf_half = type(hf)(hf.config).to(dtype)
    hf_half.load_state_dict(hf.state_dict())
    with torch.no_grad():
        ref = hf_half.eval()(ids[None], output_hidden_states=True).hidden_states[-1][0]
    out = prefill_hidden(model, [ids.tolist()]).hidden
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)


def test_sharded_checkpoint_loads_identically(tiny_checkpoints, tmp_path):
    path, hf = tiny_checkpoints["qwen2"]
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a = load_model(path, dtype="float32")
    b = load_model(tmp_path, dtype="float32")
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_packed_prefill_equals_one_by_one(tiny_checkpoints):
    model = load_model(tiny_checkpoints["qwen3"][0], dtype="float32")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 1, 33)]
    packed = prefill_hidden(model, seqs, hidden_layers=[1]).hidden
    single = torch.cat([prefill_hidden(model, [s]).hidden for s in seqs])
    torch.testing.assert_close(packed, single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [17, 45, 64])
def test_mlp_small_batch_layout_equals_the_plain_path(rows):
    """Decode-sized CPU batches run the MLP in the (W @ xᵀ) layout; the rows equal the row-major products'."""
    from mtp_train.layers.linear import takes_small_m
    from mtp_train.models.families.llama import MLP

    class Args:
        hidden_size, intermediate_size, mlp_bias = 64, 160, False

    torch.manual_seed(rows)
    mlp = MLP(Args())
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        assert takes_small_m(x, mlp.gate_up_proj.weight)
        out = mlp(x)
    gate, up = torch.nn.functional.linear(x, mlp.gate_up_proj.weight).split(160, dim=-1)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, mlp.down_proj.weight)
    assert out.shape == (rows, 64) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
