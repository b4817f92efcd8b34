"""Targets no family here implements: what a draft head needs of them, read without their layers.

With hidden states captured inside vLLM (`mtp-precompute backend=vllm`), an EAGLE-3 head trains for any target
vLLM serves: the head is a Llama-style block of its own (the layer every serving engine runs EAGLE-3 heads with),
and of the target it reads only config.json's shape keys, the input embedding and the lm_head (and, for the
capture, the final RMSNorm's weight). This module is that reading; the target's decoder layers are never touched.

`head_target_args(path)` is what head-side code (the frozen parts, head checkpoints, exports, the vLLM capture)
reads a target's shapes with: a registered family's own parse, else `foreign_args`, Llama-style `ModelArgs`
(model_type "llama": the family of the head's block) with the target's shapes and the original config in `raw`.
`load_model` keeps `args_from_dir`, so our engine never runs a foreign target as if it were a Llama.

Tensor names tried, in order (the first present wins; with `tie_word_embeddings` the lm_head is the embedding):
`EMBED_NAMES`, `LM_HEAD_NAMES`, `FINAL_NORM_NAMES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtp_train.config.head import HeadTypesWhere
from mtp_train.models.config import ModelArgs, ModelConfigError, read_config_json, rope_from_config
from mtp_train.models.families import args_from_hf_config, family_for_type

# Text decoders (`model.`), multimodal wrappers (`model.language_model.`, `language_model.model.`), GPT-2 style
# (`transformer.wte`), Mamba / Nemotron-H (`backbone.embeddings`) and unprefixed checkpoints.
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "model.embedding.weight", "transformer.wte.weight",
               "backbone.embeddings.weight", "embed_tokens.weight", "tok_embeddings.weight")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight", "output.weight",
                 "embed_out.weight")
FINAL_NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
                    "model.final_layernorm.weight", "transformer.ln_f.weight", "backbone.norm_f.weight",
                    "norm.weight")
# The head types a foreign target takes: a block of the head's own built from the target's shapes (a Llama layer),
# as each type says (`HeadType.foreign_targets`).
FOREIGN_HEAD_TYPES = HeadTypesWhere(lambda t: t.foreign_targets)
VLLM_ROUTE = ("capture its hidden states with `mtp-precompute backend=vllm`, train an eagle3 head on that folder "
              "(data.source=offline) and measure it with `mtp-eval backend=vllm`")


def is_foreign(cfg: dict[str, Any]) -> bool:
    """Whether no registered family runs config.json dict `cfg` (its `model_type`)."""
    return family_for_type(cfg.get("model_type")) is None


def foreign_dir(path: str | Path) -> bool:
    """`is_foreign` of `<path>/config.json` (False when there is none: the usual errors say so later)."""
    try:
        return is_foreign(read_config_json(path))
    except ModelConfigError:
        return False


def describe(cfg: dict[str, Any]) -> str:
    """"granite (GraniteForCausalLM)": a foreign target in messages."""
    arch = ", ".join(cfg.get("architectures") or []) or "no architectures"
    return f"{cfg.get('model_type')!r} ({arch})"


def refusal(path: str | Path, what: str) -> str:
    """The one-line message refusing `what` (e.g. "data.source=online") for the foreign target in `path`."""
    cfg = read_config_json(path)
    return f"model.path={path} is a {describe(cfg)} target, which our engine does not implement and {what} needs: " \
        f"{VLLM_ROUTE}"


def foreign_args(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """A foreign config.json dict → the Llama-style `ModelArgs` of a head's block over it.

    The target's hidden size, layer count, vocabulary, heads (Hq, Hkv, D), MLP width (4H when it names none, e.g. a
    MoE), RMSNorm eps, RoPE keys, context length, tied embeddings and stop ids; no biases, q/k norms or windows
    (the head's block has none, as the engines' EAGLE-3 layer). Raises ModelConfigError naming missing keys.
    """
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"{source}: missing required key(s) {', '.join(missing)} (a head over a "
                               f"{describe(cfg)} target reads them)")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    eps = cfg.get("rms_norm_eps", cfg.get("layer_norm_epsilon", cfg.get("norm_eps", 1e-6)))
    return ModelArgs(
        model_type="llama",  # the head block's family; the target's own type stays in raw
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(eps),
        rope=rope_from_config(cfg, head_dim, source),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        raw=dict(cfg),
    )


def head_target_args(path: str | Path) -> ModelArgs:
    """The target's args as a head reads them: its family's parse, or `foreign_args` when no family runs it."""
    cfg = read_config_json(path)
    source = str(Path(path) / "config.json")
    return foreign_args(cfg, source) if is_foreign(cfg) else args_from_hf_config(cfg, source)


def target_model_type(args: ModelArgs) -> str:
    """The target's own model_type (a foreign target's args carry the head block's "llama")."""
    return str(args.raw.get("model_type") or args.model_type)


def pick_name(names: dict[str, Any], candidates: tuple[str, ...]) -> str | None:
    """The first of `candidates` among `names` (a checkpoint's tensor index), or None."""
    return next((n for n in candidates if n in names), None)


def embedding_names(names: dict[str, Any], tied: bool, where: str | Path) -> tuple[str, str]:
    """(embedding, lm_head) tensor names in a checkpoint index `names` (the same name when `tied`).

    ModelConfigError naming the patterns tried when either is missing (an untied target without an lm_head is
    refused: the embedding is not its output projection)."""
    embed = pick_name(names, EMBED_NAMES)
    if embed is None:
        raise ModelConfigError(f"{where}: checkpoint lacks an input embedding (tried {', '.join(EMBED_NAMES)})")
    if tied:
        return embed, embed
    head = pick_name(names, LM_HEAD_NAMES)
    if head is None:
        raise ModelConfigError(f"{where}: checkpoint lacks an lm_head (tried {', '.join(LM_HEAD_NAMES)}) and "
                               "config.json does not tie it to the embedding (tie_word_embeddings)")
    return embed, head
