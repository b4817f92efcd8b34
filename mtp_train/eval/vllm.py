"""`mtp-eval backend=vllm`: a trained head exported and measured inside vLLM.

The way to measure a head for a target our engine does not implement (`models.foreign`), and a second opinion for
one it does. The head is exported in its type's layout that vLLM loads (`HeadType.serving("vllm")`: an eagle3 head
as `format=speculators`) into `<out>/export`; a vLLM engine is launched in its own environment (`vllm_python`, the
staged `capture.vllm_generate` as its main module) on the target with `speculative_config = {<the layout's
settings, e.g. method: eagle3>, model: <out>/export, num_speculative_tokens: k}`; the prompt sets are answered
turn by turn exactly as our engine's evaluation answers them (`engine.turns.answer_turns`: our chat-template
rendering, our stop ids, each later turn after vLLM's own answer), one batch per turn of a prompt set. τ, the
acceptance rate, per-position acceptance and the draft counts come from vLLM's spec-decode counters, read after
every batch, so each prompt set gets its own row.

The report has mtp-eval's files (report.json, report.md, outputs.jsonl, config.yaml) and its row fields where they
mean the same thing: dataset, method, k, temperature, label, prompts, generated_tokens, seconds, tokens_per_s,
tau, acceptance_rate, per_position, num_drafts, num_accepted, mean_draft_len (drafted tokens per step), plus
`backend: vllm` and `vllm_version`. There is no plain run beside it, so no speed-up: vLLM's CPU build measures
acceptance, not speed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtp_train import processes
from mtp_train.capture import launch
from mtp_train.capture.vllm_generate import count_delta, spec_summary
from mtp_train.config import EvalConfig
from mtp_train.config.head import HEAD_TYPES, head_type
from mtp_train.data.fingerprints import load_tokenizer
from mtp_train.data.prompts import PromptSet
from mtp_train.engine.llm import GenerationOutput
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import Dialogue, OnFinish, answer_text, answer_turns, stop_token_ids
from mtp_train.eval.options import EvalPoint, expand_grid
from mtp_train.export import export_head
from mtp_train.heads.checkpoint import read_head_config
from mtp_train.models.foreign import head_target_args
from mtp_train.models.loader import resolve_dtype

log = logging.getLogger(__name__)
ENGINE = "vllm"  # the serving engine, as the head types' layouts name it (`Layout.serves`)
GENERATE_MODULE = "mtp_train.capture.vllm_generate"
POLL_S = 0.5  # how often the driver looks for a batch's result while vLLM runs
# Grid axes our engine's drafter has and vLLM's eagle3 does not: each must keep its default value.
ENGINE_ONLY = {"draft_threshold": 0.0, "catch_up": "target", "draft_width": 1, "tree": "none"}


class VllmEvalError(ValueError):
    """vLLM could not run the head (not installed, a layout it refuses, a crash); the message says which."""


def vllm_serving(head_ckpt: str | Path) -> tuple[str, dict[str, Any]]:
    """(the export format, vLLM's speculative settings that load it) of the head in `head_ckpt`: its type's layout
    that vLLM serves (`HeadType.serving`, e.g. speculators as `method: eagle3` for an eagle3 head); VllmEvalError
    naming the types vLLM serves otherwise."""
    kind = read_head_config(head_ckpt)["head"].get("type")
    served = head_type(kind).serving(ENGINE)
    if served is None:
        takes = [name for name, t in HEAD_TYPES.items() if t.serving(ENGINE) is not None]
        raise VllmEvalError(f"backend=vllm: vLLM serves no layout of {kind} heads ({head_ckpt}); it serves "
                            f"{', '.join(takes)} heads")
    return served


def check_settings(ec: EvalConfig) -> EvalPoint:
    """The one grid point backend=vllm measures; VllmEvalError naming the key for anything else (a method other
    than mtp, no head, a grid, an option only our drafter has)."""
    if ec.method != "head" or not ec.head_ckpt:
        raise VllmEvalError(f"backend=vllm measures a trained head: method=head head_ckpt=DIR (got "
                            f"method={ec.method}, head_ckpt={ec.head_ckpt})")
    for axis, default in ENGINE_ONLY.items():
        if ec.grid(axis) != [default]:
            raise VllmEvalError(f"backend=vllm: {axis}={getattr(ec, axis)} is an option of our engine's drafter; "
                                f"vLLM's drafter drafts a chain of k ({axis}={default})")
    points = [p for p in expand_grid(ec) if p.method == "head"]
    if len(points) != 1:
        raise VllmEvalError(f"backend=vllm measures one point (one vLLM engine per setting): give one k and one "
                            f"temperature (got k={ec.k}, temperature={ec.temperature})")
    return points[0]


@dataclass
class VllmGenerator:
    """The running vLLM side (`capture.vllm_generate`): batches in on its stdin, results as files in `workdir`."""

    proc: subprocess.Popen[bytes]
    workdir: Path
    log_path: Path
    model: str
    sent: int = 0
    last: dict[str, Any] | None = None  # the latest result (its counters are cumulative)

    @property
    def version(self) -> str | None:
        """vLLM's version, once a batch has run."""
        return (self.last or {}).get("vllm_version")

    def run(self, prompts: list[list[int]], seeds: list[int]) -> dict[str, Any]:
        """One batch through vLLM; its result (module docstring of `vllm_generate`)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"prompts": prompts, "seeds": seeds}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self.error() from None
        path = self.workdir / f"batch-{self.sent}.json"
        self.sent += 1
        while not path.is_file():
            try:
                self.proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                continue
            if not path.is_file():
                raise self.error()
        self.last = json.loads(path.read_text())
        return self.last

    def error(self) -> VllmEvalError:
        """The one-line error of a vLLM side that ended, naming its log."""
        try:
            first = launch.error_line(json.loads((self.workdir / "error.json").read_text())["error"])
        except (OSError, ValueError, KeyError):
            first = f"vLLM exited with code {self.proc.poll()} and no error recorded"
        if "No module named 'vllm'" in first:
            return VllmEvalError(f"vllm_python cannot import vLLM ({first}): it must be the python of vLLM's "
                                 "environment")
        return VllmEvalError(f"vLLM could not run the head on {self.model}: {first} (its log: {self.log_path})")

    def close(self, wait_s: float = 60.0) -> None:
        """End the engine: stdin's end lets it finish (waiting up to `wait_s`); a side still running after that
        (or at once, wait_s=0: a refused or interrupted run) is stopped with vLLM's engine processes, its own
        process group (`processes.stop`, SIGKILL after 30 s)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=wait_s)
        processes.stop(self.proc, grace=30.0)


def settings(ec: EvalConfig, point: EvalPoint, export_dir: Path, dtype: torch.dtype,
             stop_ids: list[int], speculative: Mapping[str, Any]) -> dict[str, Any]:
    """The `vllm_generate` settings: the target, the head as vLLM's drafter (`speculative`: the settings that load
    its export, `vllm_serving`), sampling as mtp-eval's."""
    v = ec.vllm
    engine = v.llm_kwargs(
        model=str(Path(ec.model.path).resolve()), dtype=str(dtype).replace("torch.", ""), max_num_seqs=ec.batch_size,
        seed=ec.seed, disable_log_stats=False, max_model_len=v.max_model_len,
        speculative_config={**speculative, "model": str(export_dir.resolve()), "num_speculative_tokens": point.k})
    return {"engine": engine, "stop_token_ids": stop_ids, "max_tokens": ec.max_new_tokens,
            "temperature": point.temperature, "top_p": ec.top_p, "top_k": ec.top_k}


def start(python: Path, cfg: dict[str, Any], workdir: Path, env: Mapping[str, str], log_path: Path,
          model: str) -> VllmGenerator:
    """Launch `vllm_generate` on `cfg` (`processes.start`: in its own session, so that stopping it reaches vLLM's
    engine processes), its batches through its stdin."""
    (workdir / "settings.json").write_text(json.dumps(cfg))
    proc = processes.start([python, "-m", GENERATE_MODULE, "--settings", workdir / "settings.json",
                            "--workdir", workdir], env, log_path, cwd=workdir, stdin=True)
    return VllmGenerator(proc, workdir, log_path, model)


def answer_set(gen: VllmGenerator, ps: PromptSet, tokenizer: Any, ec: EvalConfig,
               point: EvalPoint) -> tuple[list[list[GenerationOutput]], float]:
    """Every conversation of `ps` answered by vLLM turn by turn (our rendering); outputs per conversation, seconds."""
    dialogues = [Dialogue.of(c.messages, key=i) for i, c in enumerate(ps.convs)]
    outputs: list[list[GenerationOutput]] = [[] for _ in ps.convs]
    params = SamplingParams(temperature=point.temperature, top_k=ec.top_k, top_p=ec.top_p,
                            max_new_tokens=ec.max_new_tokens, seed=ec.seed)

    def keep(d: Dialogue, out: GenerationOutput, text: str) -> bool:
        outputs[d.key].append(out)
        return True

    def generate(prompts: list[list[int]], p: SamplingParams | list[SamplingParams], on_finish: OnFinish) -> None:
        # request i of a turn is seeded seed + i, our engine's rule
        result = gen.run(prompts, [ec.seed + i for i in range(len(prompts))])
        for i, (ids, o) in enumerate(zip(prompts, result["outputs"])):
            on_finish(i, GenerationOutput(prompt_ids=ids, output_ids=o["token_ids"],
                                          finish_reason=o["finish_reason"] or "length"))

    t0 = time.perf_counter()
    answer_turns(dialogues, generate, tokenizer, params, template_kwargs=ec.chat_template_kwargs, on_answer=keep)
    return outputs, time.perf_counter() - t0


def row(dataset: str, point: EvalPoint, prompts: int, tokens: int, seconds: float, counts: dict[str, Any] | None,
        version: str | None) -> dict[str, Any]:
    """A report row in mtp-eval's field names (module docstring); counts: vLLM's counters of these answers."""
    r: dict[str, Any] = {"dataset": dataset, **point.row_fields(), "backend": "vllm", "vllm_version": version,
                         "prompts": prompts, "generated_tokens": tokens, "seconds": seconds,
                         "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}
    if counts is not None:
        s = spec_summary(counts)
        r.update(tau=s["tau"], acceptance_rate=s["acceptance_rate"], per_position=s["per_position"],
                 num_drafts=s["num_drafts"], num_accepted=s["num_accepted"],
                 mean_draft_len=s["num_draft_tokens"] / s["num_drafts"] if s["num_drafts"] else 0.0)
    return r


def add_counts(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two sets of vLLM counters summed (None: none reported)."""
    if a is None or b is None:
        return a or b
    per = [0] * max(len(a["accepted_per_pos"]), len(b["accepted_per_pos"]))
    for c in (a, b):
        for j, v in enumerate(c["accepted_per_pos"]):
            per[j] += v
    return {k: a[k] + b[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted")} | {"accepted_per_pos": per}


def evaluate_vllm(ec: EvalConfig, prompt_sets: list[PromptSet], *, environ: Mapping[str, str],
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Export the head, run it in vLLM over `prompt_sets` (module docstring); (report rows, outputs.jsonl records).

    Args:
        ec: the command's settings (model, head_ckpt, k, temperature, max_new_tokens, batch_size, out, vllm_python,
            vllm.*).
        prompt_sets: the prompt sets, already read.
        environ: the environment vLLM's process starts from (its PYTHONPATH replaced: `launch.child_env`).
    """
    point = check_settings(ec)
    try:
        python = launch.check_python(ec.vllm_python)
    except launch.CaptureError as e:
        raise VllmEvalError(str(e)) from None
    target_dir, out = Path(ec.model.path), Path(ec.out)
    args = head_target_args(target_dir)  # a target no family here runs is read for its shapes only
    tokenizer = load_tokenizer(target_dir)
    stop_ids = stop_token_ids(tokenizer, args.eos_token_ids, ec.chat_template_kwargs)
    export_dir = out / "export"
    fmt, speculative = vllm_serving(ec.head_ckpt)
    export_head(ec.head_ckpt, target_dir, fmt, export_dir, verify_fingerprint=ec.verify_fingerprint)
    dtype = resolve_dtype(ec.model.dtype, args)
    rows: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    total: tuple[int, int, float, dict[str, Any] | None] = (0, 0, 0.0, None)  # prompts, tokens, seconds, counts
    with tempfile.TemporaryDirectory(prefix="mtp-eval-vllm-") as tmp:
        env = launch.child_env(environ, launch.stage_modules(Path(tmp) / "modules"), ec.vllm.cpu_kvcache_gb)
        gen = start(python, settings(ec, point, export_dir, dtype, stop_ids, speculative), Path(tmp), env,
                    out / "vllm-eval.log", str(target_dir))
        wait_s = 0.0  # a failure stops vLLM at once; a finished run lets it shut down
        try:
            before: dict[str, Any] | None = None
            for ps in prompt_sets:
                outputs, seconds = answer_set(gen, ps, tokenizer, ec, point)
                spec = (gen.last or {}).get("spec")  # cumulative over the engine's life
                counts = count_delta(spec, before) if spec is not None else None
                before = spec
                tokens = sum(len(o.output_ids) for turns in outputs for o in turns)
                rows.append(row(ps.name, point, len(outputs), tokens, seconds, counts, gen.version))
                total = (total[0] + len(outputs), total[1] + tokens, total[2] + seconds, add_counts(total[3], counts))
                log.info("%s %s (vLLM): tau %.2f, acceptance %.2f over %d drafts", ps.name, point.label,
                         rows[-1].get("tau", 1.0), rows[-1].get("acceptance_rate", 0.0), rows[-1].get("num_drafts", 0))
                records += [{"dataset": ps.name, "id": c.id, "method": point.method, "k": point.k,
                             "temperature": point.temperature, "label": point.label, "backend": "vllm",
                             "turns": [{"prompt_tokens": len(o.prompt_ids), "output_ids": o.output_ids,
                                        "text": answer_text(tokenizer, o), "finish_reason": o.finish_reason}
                                       for o in turns]} for c, turns in zip(ps.convs, outputs)]
            wait_s = 60.0
        finally:
            gen.close(wait_s)
    rows.append(row("overall", point, *total, gen.version))
    return rows, records
