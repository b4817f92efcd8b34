"""Bad model input gets a clear error that names the file or key and says what to do."""

from __future__ import annotations

import json
import shutil

import pytest

from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.families import args_from_hf_config


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelConfigError, match=r"does not exist.*mtp-model fetch"):
        load_model(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json is missing"):
        load_model(tmp_path)


def _copy(tiny_checkpoints, tmp_path, name="llama"):
    dst = tmp_path / name
    shutil.copytree(tiny_checkpoints[name][0], dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(tiny_checkpoints, tmp_path):
    p = _copy(tiny_checkpoints, tmp_path)
    _edit_config(p, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match=r"model_type 'gpt2'.*not supported.*llama, mistral, qwen2, qwen3"):
        load_model(p)


def test_missing_config_keys(tiny_checkpoints, tmp_path):
    p = _copy(tiny_checkpoints, tmp_path)
    _edit_config(p, hidden_size=None, vocab_size=None)
    with pytest.raises(ModelConfigError, match=r"config.json: missing required key\(s\) hidden_size, vocab_size"):
        load_model(p)


def test_unsupported_rope_type():
    with pytest.raises(ModelConfigError, match="rope type .longrope. is not supported"):
        args_from_hf_config({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 4,
                                  "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_invalid_json_names_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n oops}')
    with pytest.raises(ModelConfigError, match="invalid JSON at line 2"):
        load_model(tmp_path)


def test_missing_weights_file_and_tensors(tiny_checkpoints, tmp_path):
    p = _copy(tiny_checkpoints, tmp_path)
    (p / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match="no model.safetensors"):
        load_model(p)


def test_shape_mismatch_names_tensor(tiny_checkpoints, tmp_path):
    p = _copy(tiny_checkpoints, tmp_path)
    _edit_config(p, intermediate_size=96)
    with pytest.raises(ModelConfigError, match=r"model.layers.0.mlp.*config.json implies \((64, 96|192, 64)\)"):
        load_model(p)


def test_unknown_dtype_and_backend(tiny_checkpoints):
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(tiny_checkpoints["llama"][0], dtype="int3")
    with pytest.raises(ValueError, match="unknown attention backend"):
        load_model(tiny_checkpoints["llama"][0], backend="xformers")


def test_truncated_weights_and_cut_config_name_the_file(tiny_checkpoints, tmp_path):
    p = _copy(tiny_checkpoints, tmp_path)
    weights = p / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelConfigError, match=rf"{weights}: not a readable safetensors file.*truncated"):
        load_model(p)
    text = (p / "config.json").read_text()
    (p / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(ModelConfigError, match=r"config.json: invalid JSON at line \d+ column \d+: .*; repair"):
        load_model(p)


def test_another_quantization_method_is_refused_naming_the_key(tiny_checkpoints, tmp_path):
    p = _copy(tiny_checkpoints, tmp_path)
    _edit_config(p, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ModelConfigError, match=r"config.json: quantization_config.quant_method='bitsandbytes' "
                                               r"cannot be loaded.*unquantized release"):
        load_model(p)


def test_checkpoint_reader_reads_parts_of_a_tensor(tiny_checkpoints):
    import torch

    from mtp_train.models.loader import checkpoint_files, open_checkpoint

    path = tiny_checkpoints["llama"][0]
    args = args_from_hf_config(json.loads((path / "config.json").read_text()))
    name = "model.layers.1.mlp.down_proj.weight"  # (64, 128)
    with open_checkpoint(path, args) as ckpt:
        assert set(ckpt.names) == set(checkpoint_files(path)) and ckpt.shapes[name] == (64, 128)
        full = ckpt.read(name, torch.float32)
        assert torch.equal(ckpt.read(name, torch.float32, (slice(None), slice(37, 101))), full[:, 37:101])
        assert torch.equal(ckpt.read(name, torch.float32, (slice(5, 9),)), full[5:9])
        assert ckpt.read(name, torch.bfloat16).dtype == torch.bfloat16


# One value of another JSON type per kind a key of FIELD_TYPES may have.
_WRONG = {"int": "576", "float": "1e-6", "bool": "false", "str": 3, "dict": "yes", "list": "1,8"}


def test_every_config_key_a_family_reads_is_refused_by_name_when_its_json_type_is_wrong():
    """`check_field_types` is the one place: each key of FIELD_TYPES, given text or a value of another kind, is
    refused naming the source and the key before any family converts it (a number as text passes int())."""
    from mtp_train.models.config import FIELD_TYPES

    base = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "vocab_size": 4}
    for key, (kinds, _) in FIELD_TYPES.items():
        if key == "model_type":  # the registry's look-up names it first (no family runs model_type 3)
            continue
        with pytest.raises(ModelConfigError, match=rf"^t/config.json: {key} is .*, not "):
            args_from_hf_config({**base, key: _WRONG[kinds[0]]}, source="t/config.json")
    with pytest.raises(ModelConfigError, match=r'hidden_size is "576" \(a string\), not an integer; write it '
                                               r'without quotes \("hidden_size": 576\)'):
        args_from_hf_config({**base, "hidden_size": "576"}, source="t/config.json")
    with pytest.raises(ModelConfigError, match=r"eos_token_id is \[2, \"3\"\] .*not an integer or a list of"):
        args_from_hf_config({**base, "eos_token_id": [2, "3"]}, source="t/config.json")
    assert args_from_hf_config({**base, "rms_norm_eps": 1, "eos_token_id": [2, 3], "head_dim": None}).rms_norm_eps == 1


def test_a_target_config_that_is_text_or_not_a_file_names_the_file_and_key(tiny_checkpoints, tmp_path):
    import os

    p = _copy(tiny_checkpoints, tmp_path)
    _edit_config(p, hidden_size="32")
    with pytest.raises(ModelConfigError, match=r"llama/config.json: hidden_size is \"32\" \(a string\)"):
        load_model(p)
    (p / "config.json").unlink()
    os.mkfifo(p / "config.json")  # never opened: a read would block
    with pytest.raises(ModelConfigError, match=r"config.json is not a regular file: it is a FIFO \(named pipe\)"):
        load_model(p)
    (p / "config.json").unlink()
    (p / "config.json").symlink_to("config.json")
    with pytest.raises(ModelConfigError, match=r"config.json is a link loop"):
        load_model(p)
