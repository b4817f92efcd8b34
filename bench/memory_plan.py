"""Memory plan: GPU memory per rank for precompute and training at the shipped configs, and disk per million tokens.

For Llama-3.1-8B, Llama-3.1-70B, DeepSeek-V2-Lite, Qwen3-30B-A3B, DeepSeek-V3, Kimi-K2, GPT-OSS-20B and
GPT-OSS-120B (the `conf/model` entries). Shapes come from the model folder's config.json when it is present, else
from the public config.json values embedded below; parameter counts are exact (our target and head are built on the
meta device and counted).
Memory is an estimate from those counts:

precompute (bf16, cache-free packed prefill of `batch_tokens`, tensor parallel over `model.tp` ranks):
    weights / tp + the largest per-layer temporaries of one step (hidden, q/k/v, the MLP's 2·I/tp) + output rows
training: the memory plan of `mtp-train` (`mtp_train.train.memory_plan.plan_memory`, what `mtp-train ... plan=true`
    prints) of the `mtp` head at the shipped settings on CUDA in bf16, DeepSpeed ZeRO-2 over `world` ranks: the CUDA
    runtime, frozen embedding + lm_head, the micro-batch's stored states, head weights with fp32 master, gradients,
    AdamW moments, activations of `micro_batch_tokens` rows and one vocabulary chunk of the token loss
online training (`mtp-train data.source=online`, or epoch 0 of hybrid): the same plan with the target held on
    every rank (bf16 weights / `model.tp`) and the temporaries of its prefill over one micro-batch, against each
    rank's budget (`--gpu-gib`, an H100's 79.6 GiB); the frozen embedding and lm_head are counted twice, as the
    trainer holds its own copy beside the target's.
--training-table: the plan's peak per rank for Llama-3.1-8B and Qwen3-32B targets with eagle3 and dflash heads at
    8k and 32k tokens on 8 GPUs (ZeRO-2, bf16), sequence parallelism 1 and 4, with and without activation
    checkpointing, and the `mtp-train ... plan=true` command of each row (docs/training.md "Memory plan").
disk: per token, 5 bytes of token id (int32) and loss mask (uint8), and per stored layer (the final hidden and each of
    the k aux layers the head type reads: `conf/head/*.yaml` resolved against the target's layer count) b·H bytes of
    values (b = 2 in bf16 / fp16, 4 in fp32, 1 in fp8) plus, in fp8, one float32 scale (4 bytes):
    5 + (b·H + s)·(1 + k), i.e. 5 + 2·H·(1 + k) in bf16 and 5 + (H + 4)·(1 + k) in fp8 (`disk_bytes_per_token`);
    each shard adds its safetensors header and 8 bytes of offsets per sample, and the token counts beside the shards
    are vocabulary-sized (per shard and per folder, not per token).
KV cache (inference, speculative decoding): bytes per cached token in bf16 of the target's pool on one rank (its
    KV heads under `model.tp`) and of the `mtp` head's one-layer pool (`KVCache.bytes_per_token` of each layout):
    2·Hkv·D per layer for the Llama family, one latent row of kv_lora_rank + qk_rope_head_dim for DeepSeek-V2's MLA.

Usage: python -m bench.memory_plan [--world 8] [--micro-batch-tokens N] [--gpu-gib 79.6]
       [--conversations 1000000 --tokens-per-conversation 2048 --hidden 4096 --aux 3]   (last line: one JSON object)
       python -m bench.memory_plan --training-table
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import yaml

from bench.common import ROOT, compose_train, parser, report
from mtp_train.config import HeadConfig
from mtp_train.config.head import HEAD_TYPES
from mtp_train.engine import KVCache
from mtp_train.heads import head_class
from mtp_train.models.config import ModelArgs
from mtp_train.models.families import args_from_dir, args_from_hf_config
from mtp_train.models.loader import model_class
from mtp_train.models.tensor_parallel import local_args
from mtp_train.precompute.writer import FP8_STORAGE, STORAGE_DTYPES
from mtp_train.train.memory_plan import CUDA_RUNTIME_BYTES, MemoryPlan, plan_memory, plan_settings

GIB = 2**30
TB = 10**12
ID_MASK_BYTES = 5  # per token: input_ids (int32) + loss_mask (uint8)
FP8_SCALE_BYTES = 4  # fp8 storage: one float32 scale per token and stored layer (precompute/quant.py)

# Public config.json values (Hugging Face model cards), used when the folder is not on this machine.
LLAMA31_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
LLAMA31_70B = {**LLAMA31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64}
DEEPSEEK_V2_LITE = dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                        num_attention_heads=16, num_key_value_heads=16, vocab_size=102400, q_lora_rank=None,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0,
                        tie_word_embeddings=False, rms_norm_eps=1e-6)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, max_position_embeddings=40960)
# DeepSeek-V3's and Kimi-K2-Instruct's public config.json values, counted as bf16 weights: the released checkpoints
# are FP8 block-scaled (a quantization_config, left out here, that the deepseek_v3 family refuses for now).
DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                   moe_layer_freq=1, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
                   norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1, rms_norm_eps=1e-6,
                   rope_theta=10000.0, max_position_embeddings=163840, tie_word_embeddings=False,
                   rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
           "vocab_size": 163840, "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
           "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0, "rope_theta": 50000.0,
           "max_position_embeddings": 131072,
           "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
# GPT-OSS-20B's and -120B's public config.json values, counted as bf16 weights: the released checkpoints are MXFP4
# (a quantization_config, left out here, that the gpt_oss family refuses); layer_types default to the released
# alternation (sliding, full, ...).
GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                   num_local_experts=32, num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                   swiglu_limit=7.0, rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
                   tie_word_embeddings=False,
                   rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096})
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}
# Qwen3-32B's public config.json values (the memory plan's table; no conf/model entry ships for it).
QWEN3_32B = dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False)
TABLE_TARGETS = {"Llama-3.1-8B": LLAMA31_8B, "Qwen3-32B": QWEN3_32B}
MODELS = {"llama3.1-8b": LLAMA31_8B, "llama3.1-70b": LLAMA31_70B, "deepseek-v2-lite": DEEPSEEK_V2_LITE,
          "qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v3": DEEPSEEK_V3, "kimi-k2": KIMI_K2,
          "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B}


def model_conf(name: str) -> dict:
    return yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())


def target_args(name: str) -> tuple[ModelArgs, str]:
    conf = model_conf(name)
    cfg_file = ROOT / conf["path"] / "config.json"
    if cfg_file.is_file():
        return args_from_dir(cfg_file.parent), str(cfg_file)
    return args_from_hf_config(MODELS[name], source=f"{name} (public config.json values)"), "embedded"


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def disk_bytes_per_token(hidden_size: int, aux_layers: int, storage: str = "bfloat16") -> int:
    """Bytes one token takes in a precompute folder's shards, headers and per-sample offsets left out.

    Args:
        hidden_size: H, the target's hidden width.
        aux_layers: k, the aux layers stored beside the final hidden (each as wide as it).
        storage: the folder's `hidden_dtype` (bfloat16 | float16 | float32 | float8_e4m3).

    5 + (b·H + s)·(1 + k): token id and mask, then b bytes per value of each of the 1 + k stored layers and, in fp8,
    one float32 scale per token and layer (s = 4).
    """
    value = STORAGE_DTYPES[storage].itemsize
    scale = FP8_SCALE_BYTES if storage == FP8_STORAGE else 0
    return ID_MASK_BYTES + (value * hidden_size + scale) * (1 + aux_layers)


def head_names() -> list[str]:
    """The head types with a shipped config (`conf/head/<name>.yaml`), in the registry's order."""
    return [name for name in HEAD_TYPES.names() if (ROOT / "conf" / "head" / f"{name}.yaml").is_file()]


def stored_aux_layers(head: str, num_layers: int) -> list[int]:
    """The aux layers a precompute folder must store for head type `head` at its shipped config
    (`conf/head/<head>.yaml`) on a target of `num_layers` layers: its `aux_layers`, or the type's default when []
    ([2, L//2, L-3] for eagle3, five spread for the block drafters); [] for a head that reads the final hidden only."""
    conf = yaml.safe_load((ROOT / "conf" / "head" / f"{head}.yaml").read_text())
    conf = conf.get("head", conf)  # the types that bring a recipe nest their head settings under `head:`
    resolved = HeadConfig.from_dict(conf).resolved(num_layers)
    return list(resolved.aux_layers) if resolved.features == "aux" else []


def disk_plan(hidden_size: int, num_layers: int) -> dict[str, dict]:
    """Per shipped head type: the aux layers its folder stores, bytes per token and GiB per million tokens in each
    storage dtype."""
    out = {}
    for head in head_names():
        k = len(stored_aux_layers(head, num_layers))
        per_token = {s: disk_bytes_per_token(hidden_size, k, s) for s in STORAGE_DTYPES}
        out[head] = {"aux_layers": k, "bytes_per_token": per_token,
                     "gib_per_million_tokens": {s: round(b * 1e6 / GIB, 2) for s, b in per_token.items()}}
    return out


def plan(name: str, world: int, batch_tokens: int, micro_tokens: int, chunk: int, steps: int,
         gpu_gib: float = 79.6) -> dict:
    args, source = target_args(name)
    tp = int(model_conf(name).get("tp", 1))
    with torch.device("meta"):
        target = model_class(args)(args)
        head = head_class("mtp")(HeadConfig(type="mtp"), args, None)
    p_target, p_head = count(target), count(head)
    h = args.hidden_size
    inter = args.intermediate_size
    # the widest MLP of a step: the dense layers', or an MoE layer's active (and shared) experts'
    active = getattr(args, "num_experts_per_tok", 0) + getattr(args, "n_shared_experts", 0)
    inter = max(inter, getattr(args, "moe_intermediate_size", 0) * active)
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    bf16 = 2

    pre_weights = p_target * bf16 / tp

    def prefill_temporaries(rows: int) -> float:  # one cache-free prefill step of `rows` tokens, plus its output
        return rows * (4 * h + qkv / tp + 3 * inter / tp) * bf16 + rows * h * bf16

    pre_act = prefill_temporaries(batch_tokens)
    overrides = [f"train.micro_batch_tokens={micro_tokens}", f"loss.chunk_size={chunk}", f"loss.steps={steps}",
                 f"model.tp={tp}"]
    train_plan = training_plan(args, overrides, world, micro_tokens)
    online_plan = training_plan(args, overrides + ["data.source=online"], world, micro_tokens)
    train, online = train_plan.total, online_plan.total
    frozen = next(t.bytes for t in train_plan.terms if t.name == "frozen")
    act = next(t.bytes for t in train_plan.terms if t.name == "activations")
    rank_args = local_args(args, tp) if tp > 1 else args
    kv_target = KVCache.bytes_per_token(args.num_layers, rank_args.kv_layout, torch.bfloat16)
    kv_head = KVCache.bytes_per_token(*head.kv_shape, torch.bfloat16)
    disk = disk_plan(h, args.num_layers)
    return {
        "model": name, "config": source, "target_params_b": round(p_target / 1e9, 2),
        "head_params_m": round(p_head / 1e6, 1), "tp": tp,
        "precompute_gib_per_rank": round((pre_weights + pre_act) / GIB, 1),
        "train_gib_per_rank": round(train / GIB, 1),
        "train_frozen_gib": round(frozen / GIB, 2), "train_activations_gib": round(act / GIB, 2),
        "hidden_size": h, "disk": disk,
        "disk_gib_per_million_tokens": {head: d["gib_per_million_tokens"]["bfloat16"] for head, d in disk.items()},
        "kv_kib_per_token_target": round(kv_target / 1024, 1), "kv_kib_per_token_head": round(kv_head / 1024, 1),
        "online_target_gib_per_rank": round(pre_weights / GIB, 1),
        "online_prefill_gib": round(prefill_temporaries(micro_tokens) / GIB, 2),
        "train_terms_gib": {t.name: round(t.bytes / GIB, 3) for t in train_plan.terms},
        "online_gib_per_rank": round(online / GIB, 1), "online_headroom_gib": round(gpu_gib - online / GIB, 1),
        "online_fits": online / GIB <= gpu_gib,
    }


def training_plan(args: ModelArgs, overrides: list[str], world: int, length: int, head: str = "mtp") -> MemoryPlan:
    """`mtp-train`'s memory plan on CUDA (bf16) for a target of shapes `args`: the train config composed with
    `head=<head>` and `overrides`, planned for `world` ranks and samples of `length` tokens."""
    cfg = compose_train([f"head={head}", *overrides])
    from mtp_train.config import TrainConfig, typed

    tc = typed(cfg, TrainConfig)
    return plan_memory(plan_settings(tc, args, "cuda", world, length, CUDA_RUNTIME_BYTES), args)


TABLE_HEADS = ("eagle3", "dflash")
TABLE_LENGTHS = (8192, 32768)
TABLE_SP = (1, 4)


def training_table(world: int = 8) -> list[dict]:
    """The plan's peak per rank for each `TABLE_TARGETS` target, head, length, SP degree and activation
    checkpointing on `world` GPUs (ZeRO-2, bf16), with the `mtp-train ... plan=true` command that prints each
    (its target folder: a temporary one holding the public config.json only)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory-plan-") as tmp:
        for name, config in TABLE_TARGETS.items():
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
            args = args_from_dir(folder)
            for head in TABLE_HEADS:
                for length in TABLE_LENGTHS:
                    for sp in TABLE_SP:
                        for ckpt in (False, True):
                            over = [f"train.micro_batch_tokens={length}", f"train.sequence_parallel={sp}",
                                    f"train.activation_checkpointing={str(ckpt).lower()}"]
                            plan = training_plan(args, over, world, length, head)
                            terms = {t.name: round(t.bytes / GIB, 2) for t in plan.terms}
                            command = (f"mtp-train model.path=<folder with {name}'s config.json> head={head} plan=true "
                                       f"plan_world={world} plan_length={length} plan_device=cuda " + " ".join(over))
                            rows.append({"target": name, "head": head, "tokens": length, "sp": sp,
                                         "activation_checkpointing": ckpt, "peak_gib": round(plan.total / GIB, 1),
                                         "largest": plan.largest().name, "terms_gib": terms, "command": command})
    return rows


def print_training_table(rows: list[dict], world: int, gpu_gib: float) -> None:
    print(f"predicted peak per rank (GiB), {world} GPUs, ZeRO-2, bf16; one sample per micro-batch "
          f"(train.micro_batch_tokens = its length); a GPU of {gpu_gib} GiB\n")
    print("| target | head | tokens | SP | act. ckpt | peak GiB/rank | activations | loss chunk | attention grad "
          "| largest | fits |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        t = r["terms_gib"]
        print(f"| {r['target']} | {r['head']} | {r['tokens']} | {r['sp']} | "
              f"{'on' if r['activation_checkpointing'] else 'off'} | {r['peak_gib']} | {t['activations']} | "
              f"{t['loss chunk']} | {t.get('attention grad', '–')} | {r['largest']} | "
              f"{'yes' if r['peak_gib'] <= gpu_gib else 'no'} |")
    print("\ncommands:")
    for r in rows:
        print(f"  {r['command']}")


def disk_total(conversations: int, tokens_per_conversation: int, hidden_size: int, aux_layers: int) -> dict:
    """Bytes of a whole folder of `conversations` × `tokens_per_conversation` tokens, per storage dtype.

    Args:
        conversations: samples in the folder.
        tokens_per_conversation: tokens per sample.
        hidden_size: H.
        aux_layers: k, stored beside the final hidden.
    """
    tokens = conversations * tokens_per_conversation
    return {s: disk_bytes_per_token(hidden_size, aux_layers, s) * tokens for s in STORAGE_DTYPES}


def print_disk(rows: list[dict], args: argparse.Namespace) -> dict:
    """The disk table of every model by the aux layers its head types store, the formula, and the total of the
    `--conversations` × `--tokens-per-conversation` example; returns that total's figures."""
    print("\ndisk per token: 5 + (b·H + s)·(1 + k) bytes (token id int32 + loss mask uint8; per stored layer, the "
          "final hidden and k aux layers, b bytes per value and s bytes of scale):")
    print("  bf16 / fp16: 5 + 2·H·(1 + k)    fp32: 5 + 4·H·(1 + k)    fp8 (float8_e4m3): 5 + (H + 4)·(1 + k)  "
          "(one float32 scale per token and stored layer)")
    print("  plus, per shard, its safetensors header and 8 bytes of offsets per sample, and vocabulary-sized token "
          "counts\n")
    print("| model | H | head types (aux layers k) | bf16 / fp16 B/token | fp8 B/token | bf16 GiB / 1M tokens "
          "| fp8 GiB / 1M tokens |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        by_k: dict[int, list[str]] = {}
        for head, d in r["disk"].items():
            by_k.setdefault(d["aux_layers"], []).append(head)
        for k, heads in sorted(by_k.items()):
            d = r["disk"][heads[0]]
            print(f"| {r['model']} | {r['hidden_size']} | {', '.join(heads)} (k={k}) | "
                  f"{d['bytes_per_token']['bfloat16']} | {d['bytes_per_token'][FP8_STORAGE]} | "
                  f"{d['gib_per_million_tokens']['bfloat16']} | {d['gib_per_million_tokens'][FP8_STORAGE]} |")
    total = disk_total(args.conversations, args.tokens_per_conversation, args.hidden, args.aux)
    print(f"\n{args.conversations:,} conversations × {args.tokens_per_conversation} tokens at H {args.hidden} with "
          f"{args.aux} aux layers: " + ", ".join(f"{s} {b / TB:.1f} TB ({b / 2**40:.1f} TiB)"
                                                  for s, b in total.items()))
    return {"conversations": args.conversations, "tokens_per_conversation": args.tokens_per_conversation,
            "hidden_size": args.hidden, "aux_layers": args.aux,
            "bytes_per_token": {s: disk_bytes_per_token(args.hidden, args.aux, s) for s in STORAGE_DTYPES},
            "tb": {s: round(b / TB, 1) for s, b in total.items()}}


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--world", type=int, default=8, help="training ranks (ZeRO-2 shards optimizer state over them)")
    pre = yaml.safe_load((ROOT / "conf" / "precompute.yaml").read_text())
    train = yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())
    ap.add_argument("--batch-tokens", type=int, default=int(pre["batch_tokens"]))
    ap.add_argument("--micro-batch-tokens", type=int, default=int(train["train"]["micro_batch_tokens"]))
    ap.add_argument("--gpu-gib", type=float, default=79.6, help="memory per GPU (H100 80 GB: 79.6 GiB)")
    ap.add_argument("--conversations", type=int, default=10**6, help="the disk total's samples")
    ap.add_argument("--tokens-per-conversation", type=int, default=2048, help="the disk total's tokens per sample")
    ap.add_argument("--hidden", type=int, default=4096, help="the disk total's hidden width H")
    ap.add_argument("--aux", type=int, default=3, help="the disk total's aux layers k (eagle3 stores 3)")
    ap.add_argument("--training-table", action="store_true",
                    help="only the training plan's table (Llama-3.1-8B, Qwen3-32B; eagle3, dflash; 8k, 32k; SP 1, 4)")
    args = ap.parse_args(argv)
    if args.training_table:
        rows = training_table(args.world)
        print_training_table(rows, args.world, args.gpu_gib)
        result = {"world": args.world, "gpu_gib": args.gpu_gib, "training_table": rows}
        report(result)
        return result
    chunk, steps = int(train["loss"]["chunk_size"]), int(train["loss"]["steps"])
    rows = [plan(m, args.world, args.batch_tokens, args.micro_batch_tokens, chunk, steps, args.gpu_gib)
            for m in MODELS]
    print(f"precompute: batch_tokens={args.batch_tokens}, bf16; training: micro_batch_tokens="
          f"{args.micro_batch_tokens}, loss.steps={steps}, chunk_size={chunk}, ZeRO-2 over {args.world} ranks\n")
    heads = head_names()
    print("| model | target params | tp | precompute GiB/rank | head params | train GiB/rank | disk GiB / 1M tokens "
          f"bf16 ({' / '.join(heads)}) | KV cache KiB/token (target per rank + head) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        disk = " / ".join(str(r["disk_gib_per_million_tokens"][h]) for h in heads)
        print(f"| {r['model']} | {r['target_params_b']}B | {r['tp']} | {r['precompute_gib_per_rank']} | "
              f"{r['head_params_m']}M | {r['train_gib_per_rank']} | {disk} | "
              f"{r['kv_kib_per_token_target']} + {r['kv_kib_per_token_head']} |")
    disk_example = print_disk(rows, args)
    print(f"\nonline training (data.source=online, hybrid's epoch 0): the target on every rank, {args.world} ranks of "
          f"{args.gpu_gib} GiB\n")
    print("| model | tp | target GiB/rank | prefill temporaries GiB | training GiB/rank | online GiB/rank | "
          "headroom GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['tp']} | {r['online_target_gib_per_rank']} | {r['online_prefill_gib']} | "
              f"{r['train_gib_per_rank']} | {r['online_gib_per_rank']} | {r['online_headroom_gib']} |")
    result = {"world": args.world, "gpu_gib": args.gpu_gib, "batch_tokens": args.batch_tokens,
              "micro_batch_tokens": args.micro_batch_tokens, "disk_example": disk_example,
              "models": {r["model"]: r for r in rows}}
    report(result)
    return result


if __name__ == "__main__":
    main()
