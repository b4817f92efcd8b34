"""Shared fixtures: tiny random checkpoints of every supported family, and the real default model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mtp_train.layers import cpu_kernels

# The tests check results, never timings: every op with a native kernel takes it (as MTP_TRAIN_KERNEL_CHOICE=native
# does), here and in the commands the tests run, so no test's path depends on what this machine measured at the
# time. The measured choice has tests of its own (tests/test_kernel_choice.py).
os.environ.setdefault("MTP_TRAIN_KERNEL_CHOICE", "native")
TEST_KERNEL_SETTINGS = cpu_kernels.KernelSettings(choice=os.environ["MTP_TRAIN_KERNEL_CHOICE"])
cpu_kernels.configure(TEST_KERNEL_SETTINGS)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"
SHARED_DATA = ROOT.parent / "shared" / "data"

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOPICS = ["the moon", "bread", "rivers", "chess", "owls", "glass", "tea", "maps"]


_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)

# name → (transformers config class name, overrides)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3-rope": ("LlamaConfig", {
        "tie_word_embeddings": False, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": 16}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 32}),
}


def make_tiny_checkpoint(name: str, out: Path, seed: int = 0, **config):
    """Save a random tiny HF model of family `name` to `out`; return the HF model (fp32, eval).

    config: fields that replace the tiny defaults (e.g. num_hidden_layers=5 for room for three aux layers).
    """
    import transformers

    cls_name, over = TINY_CONFIGS[name]
    cfg = getattr(transformers, cls_name)(**{**_BASE, **over, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    # Random init gives tiny weights; scale norms away from 1 so the norms are really tested.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.1)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


def make_chat_target(out: Path, texts: list[str] | None = None, num_layers: int = 2) -> Path:
    """A random Llama of `num_layers` layers whose vocabulary is a small byte-level BPE with ChatML specials and
    template (trained on `texts`, by default sentences about TOPICS), saved with its tokenizer to `out`.

    num_layers >= 7 leaves room for EAGLE-3's default aux layers [2, L//2, L-3] (distinct from 7 on)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    texts = texts or [f"Tell me about {t}. Here is a fact about {t}." for t in TOPICS]
    tok.train_from_iterator(texts * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                                eos_token="<|im_end|>")
    fast.chat_template = CHATML
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256,
                                   tie_word_embeddings=False, eos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return out


def predictable_chat_target(out: Path):
    """`make_chat_target` with its layers scaled down (the next token mostly follows from the last one alone) and a
    head that predicts just that, lm_head(norm(embedding)), so its drafts are accepted often, not always (τ
    strictly between 1 and k + 1, where a random head would accept nothing and make every τ 1).

    Returns (model, tokenizer, head, path)."""
    from mtp_train.config import HeadConfig
    from mtp_train.data.chat import load_tokenizer
    from mtp_train.heads import build_head
    from mtp_train.models import load_model

    path = make_chat_target(out)
    model = load_model(path, dtype="float32", device="cpu")
    head = build_head(HeadConfig(type="mtp", init="last_layer"), path)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w.mul_(0.4)
        h = head.fc.weight.shape[0]
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)  # the embedding through, the target's hidden state left out
        head.enorm.weight.fill_(1.0)
        head.norm.weight.copy_(model.state_dict()["model.norm.weight"])
        head.layers[0].self_attn.o_proj.weight.zero_()  # the layer adds nothing to its residual
        head.layers[0].mlp.down_proj.weight.zero_()
    return model, load_tokenizer(path), head, path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """All tiny families, saved once per session: name → (folder, HF model)."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: (root / name, make_tiny_checkpoint(name, root / name)) for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2 folder; skip when it has not been fetched (`make model`)."""
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip(f"{DEFAULT_MODEL} missing: run `make model`")
    return DEFAULT_MODEL


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread on a shared two-core machine; use with
    `pytestmark = pytest.mark.usefixtures("one_thread")` (module scope: set before the module's runs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def metrics_by_step(out: Path) -> dict[int, dict[str, Any]]:
    """A training run's metrics.jsonl as step → every value logged at that step."""
    rows: dict[int, dict[str, Any]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


def compose_config(name: str, overrides: list[str]) -> Any:
    """The composed Hydra config of command `name` (conf/<name>.yaml) with `overrides`, as the command composes it."""
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(name, overrides=overrides)


def write_jsonl(path: Path, rows: list) -> Path:
    """`rows` as a JSON-lines file at `path`; returns the path."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def topic_conversations(folder: Path) -> tuple[Path, Path]:
    """(conversations, prompts) JSONL files in `folder`: two one-turn chats per TOPICS entry, and a prompt set of
    the first three topics (what a tiny `make_chat_target` trains and is evaluated on)."""
    convs = write_jsonl(folder / "convs.jsonl", [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about {t}."},
                                     {"role": "assistant", "content": f"Here is a fact about {t}. " * 3}]}
        for i, t in enumerate(TOPICS * 2)])
    prompts = write_jsonl(folder / "prompts.jsonl", [{"id": t, "prompt": f"Tell me about {t}."} for t in TOPICS[:3]])
    return convs, prompts


def precompute_and_train(tmp_path: Path, train_overrides: list[str]) -> tuple[Path, Path, Path]:
    """A tiny chat target's `topic_conversations` through `mtp-precompute` (aux layers 1 and 2) and `mtp-train` on
    the CPU (small batches, lr 3e-2, every step logged, no periodic saves, spec_eval on the prompts at k = 3) with
    `train_overrides` (the head, its loss, steps, evaluation); returns (target, prompts, the run folder)."""
    from mtp_train.cli.precompute import precompute_main
    from mtp_train.cli.train import train_main

    target = make_chat_target(tmp_path / "target")
    convs, prompts = topic_conversations(tmp_path)
    precompute_main(compose_config("precompute", [
        f"model.path={target}", "model.device=cpu", f"data.paths=[{convs}]", f"out={tmp_path / 'pc'}",
        "max_seq_len=64", "progress=false", "val_fraction=0.25", "aux_layers=[1,2]"]))
    train_main(compose_config("train", [
        f"model.path={target}", "model.device=cpu", "model.backend=torch", f"data.dir={tmp_path / 'pc'}",
        f"out={tmp_path / 'run'}", "wandb.mode=disabled", "train.progress=false", "train.micro_batch_tokens=256",
        "train.eval_batches=2", "train.save_every=0", "optim.lr=3e-2", "optim.warmup_steps=1", "train.log_every=1",
        f"spec_eval.prompts=[{prompts}]", "spec_eval.k=3", "spec_eval.max_new_tokens=8", *train_overrides]))
    return target, prompts, tmp_path / "run"
