"""What the benchmarks share: the checkout's paths, the argument parser, robust timing, the one-JSON-line report,
Hydra composition as the commands do it, the machine's matmul peak, a small precompute folder, a head run on
held-out prompts.

Heavy imports (hydra, transformers, the package's models) are made inside the functions that need them, so that
importing this module costs a benchmark nothing it does not use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"
SHARED_DATA = ROOT.parent / "shared" / "data"
# the shared self-distilled conversations (SmolLM2's greedy answers), where a checkout has them beside it
REGEN_DATA = SHARED_DATA / "train" / "regen_smollm2_greedy.jsonl"
MT_BENCH = SHARED_DATA / "dev" / "mt_bench_question.jsonl"


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose help is the benchmark's module docstring, kept as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def ints(text: str) -> list[int]:
    """A comma-separated list of integers ("1,2,4") as a list."""
    return [int(x) for x in text.split(",") if x.strip()]


# --- timing and the report ----------------------------------------------------------------------------------------


def compare(ours: Callable[[], object], baseline: Callable[[], object], repeat: int = 5,
            warmup: int = 1) -> tuple[float, float, float]:
    """Time ours and the baseline alternately; returns (median ours s, median baseline s, median ratio).

    The ratio (baseline / ours, > 1 = ours faster) is taken per round, so load that comes and goes on a
    shared machine hits both sides of a round alike instead of skewing one side's median.
    """
    for _ in range(warmup):
        ours()
        baseline()
    t_ours, t_base, ratios = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ours()
        t1 = time.perf_counter()
        baseline()
        t2 = time.perf_counter()
        t_ours.append(t1 - t0)
        t_base.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(t_ours), statistics.median(t_base), statistics.median(ratios)


def peak_matmul_gflops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeat: int = 10) -> float:
    """The best GFLOP/s of `repeat` n×n by n×n matmuls (2·n³ FLOPs each) on device in dtype.

    The best, not the median: a peak is what the machine can do, so load from elsewhere during some of the repeats
    lowers the achieved side of a ratio against it, never inflates the ratio.
    """
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def report(results: dict) -> None:
    """Print the results as the benchmark's last line: one JSON object."""
    print(json.dumps(results, sort_keys=True))


# --- configs and data ---------------------------------------------------------------------------------------------


def compose(config_name: str, overrides: list[str]) -> Any:
    """The Hydra config `config_name` (conf/<config_name>.yaml) composed with `overrides`, as the CLIs see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name, overrides=overrides)


def compose_train(overrides: list[str], experiment: str | None = None) -> Any:
    """The `train` config composed by Hydra with `overrides` (and `+experiment=<name>` first, when given)."""
    return compose("train", ([f"+experiment={experiment}"] if experiment else []) + overrides)


def random_samples(n: int, max_seq_len: int, vocab: int, seed: int = 0) -> list[Any]:
    """n random token sequences (precompute `Sample`s) of max_seq_len/4..max_seq_len tokens, ~70% in the loss."""
    from mtp_train.precompute import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(max(2, max_seq_len // 4), max_seq_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        mask = (torch.rand(length, generator=g) < 0.7).long().tolist()
        out.append(Sample(id=f"rand-{i:04d}", input_ids=ids, loss_mask=mask))
    return out


def make_precompute(model_dir: str | Path, out_dir: str | Path, data: str | Path | None = REGEN_DATA,
                    limit: int = 64, max_seq_len: int = 512, val_fraction: float = 0.1,
                    aux_layers: list[int] | None = None) -> tuple[str, str]:
    """Precompute the target's hidden states of a small data set into out_dir; returns (what, data name).

    Args:
        model_dir: the target's folder (run in fp32 on the CPU).
        out_dir: the precompute folder to write.
        data: conversations; when the file exists the folder holds them ("conversations:<file>"), else random
            token samples ("random").
        limit: conversations (or random samples).
        max_seq_len: tokens per sample at most.
        val_fraction: the share held out for validation.
        aux_layers: the target layers (hidden_states numbering) stored beside the final hidden, for heads that read
            them (eagle3, dflash, dspark); None = none.

    The data name is the one recorded in the folder's manifest (pass it as `data.name`).
    """
    from transformers import AutoTokenizer

    from mtp_train.config import DataConfig, PrecomputeConfig
    from mtp_train.data import chat_template_fingerprint, tokenizer_fingerprint
    from mtp_train.data.samples import build_samples
    from mtp_train.models import load_model
    from mtp_train.precompute import precompute

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cfg = PrecomputeConfig(out=str(out_dir), max_seq_len=max_seq_len, limit=limit, val_fraction=val_fraction,
                           seed=0, progress=False, aux_layers=list(aux_layers or []))
    if data is not None and Path(data).is_file():
        cfg.data = DataConfig(name=Path(data).stem, paths=[str(data)])
        samples, info = build_samples(tok, cfg)
        kind = f"conversations:{Path(data).name}"
    else:
        samples = random_samples(limit, max_seq_len, len(tok))
        info = {"name": "random", "limit": limit, "max_seq_len": max_seq_len}
        kind = "random"
    model = load_model(str(model_dir), dtype="float32")
    precompute(model, samples, cfg, tokenizer_fingerprint=tokenizer_fingerprint(tok),
               chat_template_fingerprint=chat_template_fingerprint(tok), model_dir=str(model_dir), data_info=info)
    del model
    return kind, str(info["name"])


# --- a head on held-out prompts (bench.tree, bench.tree_rules, bench.spec) ---------------------------------------


def head_proposer(head: Any, **options: Any) -> Any:
    """A fresh proposer of a trained head: its head type's drafter (`HeadType.drafter`) with these options (e.g.
    tree=TreeSpec(3, 4, 8), draft_width=2; none = the type's defaults)."""
    from mtp_train.config import head_type

    return head_type(head.cfg.type).drafter(head, options)


def demo_head_dir(conf: Path | None = None) -> str:
    """The head `make demo` trains, the benches' default: the one its `stages.json` records where the demo has run,
    else where the demo config's training will write it (`<out>/train/heads/step-<train.max_steps>`).

    Args:
        conf: the demo's config (default `conf/demo.yaml`); its `out` is relative to the working directory, as the
            demo's."""
    from omegaconf import OmegaConf

    from mtp_train.cli.demo import recorded_head_dir
    from mtp_train.config import CONF_DIR

    conf = Path(CONF_DIR) / "demo.yaml" if conf is None else conf
    cfg = OmegaConf.load(conf)
    out = Path(cfg.out)
    recorded = recorded_head_dir(out)
    if recorded:
        return recorded
    steps = [o.split("=", 1)[1] for o in cfg.train if str(o).startswith("train.max_steps=")]
    if not steps:
        raise ValueError(f"{conf}: its train overrides set no train.max_steps; pass --head")
    return str(out / "train" / "heads" / f"step-{steps[-1]}")


def head_run_args(doc: str | None) -> argparse.ArgumentParser:
    """The options of a run of a head on held-out prompts: model, head, prompts, limit, new tokens, batch; parse them
    with `parse_head_run`, which fills the default head."""
    ap = parser(doc)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--head", default=None,
                    help="head folder (mtp-train's heads/step-N; default: the demo's, as its stages.json records it)")
    ap.add_argument("--prompts", default="demo-heldout")
    ap.add_argument("--limit", type=int, default=16, help="conversations")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=8, help="τ runs' batch (τ does not depend on it)")
    return ap


def parse_head_run(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`ap.parse_args(argv)` with `--head` defaulting to the demo's head (`demo_head_dir`), looked up only when
    `--head` is not given; a demo config that cannot name it is a usage error."""
    args = ap.parse_args(argv)
    if args.head is None:
        try:
            args.head = demo_head_dir()
        except ValueError as exc:
            ap.error(str(exc))
    return args


def load_head_run(args: argparse.Namespace, model: Any = None) -> tuple[Any, Any, Any, list[Any], list[int]]:
    """`head_run_args`' model (float32; `model` when already loaded), tokenizer, head, prompt sets and stop ids."""
    from mtp_train.data.chat import load_tokenizer
    from mtp_train.data.prompts import load_prompt_sets
    from mtp_train.engine.turns import stop_token_ids
    from mtp_train.heads import load_head
    from mtp_train.models import load_model

    model = load_model(args.model, dtype="float32") if model is None else model
    tokenizer = load_tokenizer(args.model)
    head = load_head(args.head, args.model, dtype=torch.float32)
    sets = load_prompt_sets([args.prompts], args.limit)
    return model, tokenizer, head, sets, stop_token_ids(tokenizer, model.args.eos_token_ids)
