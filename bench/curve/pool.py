"""The training prompt pool of the long curve (issue: blocks past the crossover): the demo's kind of prompts plus chat
and code from the shared pool, one seeded sample, written as one prompt file for `mtp-regenerate`.

The pool: every prompt of `data/demo_prompts*.jsonl` (the demo's 960) and a seeded sample of the shared chat and
code pools (`../shared/data/train/mix_{chat,code}_prompts_dedup.jsonl`, already free of public evaluation prompts),
each at most `--max-chars` characters (the long ShareGPT pastes would be cut at the curve's 768-token samples
anyway); no prompt of the held-out set (`data/demo_heldout.jsonl`) and no repeated prompt. The file is derived
data: it goes under `runs/`, never into the repository.

Usage: python -m bench.curve.pool --out runs/curve2m/prompts.jsonl [--chat 2048] [--code 1088] [--seed 0]
then:  mtp-regenerate data=shared-mix 'data.paths=[runs/curve2m/prompts.jsonl]' out=runs/curve2m/regenerated.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data" / "train"
DEMO = sorted((ROOT / "data").glob("demo_prompts*.jsonl"))
HELDOUT = "demo-heldout"  # the held-out prompt set (conf/data), never in the pool


def read_prompts(path: Path) -> list[dict]:
    """The records of a prompt file (`{"prompt", ...}` per line), each with its id (the file's own, else
    `<file stem>-<line>`)."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            rid = rec.get("id") or f"{path.stem}-{rec.get('source_id') or i}"
            rows.append({"id": str(rid), "prompt": rec["prompt"], "source": path.stem})
    return rows


def heldout_texts() -> set[str]:
    """Every user turn of the held-out set, as the project reads it (`conf/data/demo-heldout.yaml`: its format and
    field map); a prompt equal to one of them never enters the pool."""
    import dataclasses

    from mtp_train.data.prompts import data_config
    from mtp_train.data.readers import read_conversations

    d = data_config(HELDOUT, ROOT / "conf")
    convs, _ = read_conversations(dataclasses.replace(d, paths=[str(ROOT / q) for q in d.paths]))
    return {m["content"].strip() for c in convs for m in c.messages if m["role"] == "user"}


def build(chat: int, code: int, seed: int, max_chars: int) -> list[dict]:
    """The pool: the demo's prompts, then `chat` and `code` sampled prompts, shuffled together (seeded)."""
    if not SHARED.is_dir():
        raise SystemExit(f"{SHARED} is missing: the shared prompt pool is needed (see ../shared/data/README.md)")
    rng = random.Random(seed)
    banned = heldout_texts()
    seen: set[str] = set()
    pool: list[dict] = []

    def take(rows: list[dict], n: int | None) -> None:
        kept = [r for r in rows if len(r["prompt"]) <= max_chars and r["prompt"].strip() not in banned]
        rng.shuffle(kept)
        got = 0
        for r in kept:
            key = r["prompt"].strip()
            if key in seen:
                continue
            seen.add(key)
            pool.append(r)
            got += 1
            if n is not None and got == n:
                return
        if n is not None:
            raise SystemExit(f"only {got} usable prompts for a sample of {n}")

    for path in DEMO:
        take(read_prompts(path), None)
    take(read_prompts(SHARED / "mix_chat_prompts_dedup.jsonl"), chat)
    take(read_prompts(SHARED / "mix_code_prompts_dedup.jsonl"), code)
    rng.shuffle(pool)
    return unique_ids(pool)


def unique_ids(pool: list[dict]) -> list[dict]:
    """Each record's id made unique where a source repeats one (ShareGPT ids name a conversation, and a pool may
    hold two of its turns): the first keeps it, a later one gets `#2`, `#3`, ... (mtp-regenerate keeps one record per
    id, so a repeated id would silently drop a prompt)."""
    seen: dict[str, int] = {}
    for r in pool:
        n = seen.get(r["id"], 0) + 1
        seen[r["id"]] = n
        if n > 1:
            r["id"] = f"{r['id']}#{n}"
    return pool


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the prompt file to write (JSONL)")
    ap.add_argument("--chat", type=int, default=2048, help="prompts sampled from the shared chat pool")
    ap.add_argument("--code", type=int, default=1088, help="prompts sampled from the shared code pool")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-chars", type=int, default=1500, help="longest prompt kept, in characters")
    args = ap.parse_args(argv)
    pool = build(args.chat, args.code, args.seed, args.max_chars)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in pool:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(args.out)
    counts: dict[str, int] = {}
    for r in pool:
        counts[r["source"]] = counts.get(r["source"], 0) + 1
    print(f"{len(pool)} prompts → {args.out}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
