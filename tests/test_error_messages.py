"""The errors a careless user meets end in one line that names the file, line or argument and what to do, never a
traceback: data paths that are not files, command-line arguments Hydra cannot read, unreadable parquet, repeated
ids, a broken chat template or tokenizer, a write that finds no room, and Ctrl-C (which says where it stopped; a
re-run goes on from there to the bytes an uninterrupted run writes).

The commands run through their console entry points, in this process (`run_cli`) where only the message matters,
and as subprocesses where the process itself is the point: under a file size limit (`RLIMIT_FSIZE`), and with
SIGINT raised at a chosen write.

A full disk is met two ways. An unprivileged test cannot mount a small file system, so the commands run under a
file size limit instead: the kernel refuses a write past it with EFBIG (Python ignores SIGXFSZ), through the same
code paths as ENOSPC, at a point fixed by the sizes of the files (the first shard bigger than the limit). ENOSPC
itself comes from /dev/full, whose every write fails with it: `atomic_write`, the seam every output goes through,
is handed a writer that copies into it.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mtp_train.fileio import DiskFullError, atomic_write, atomic_write_text
from tests.test_bad_inputs import PRECOMPUTE, TRAIN, World, _chat, _jsonl, run_cli, tree
from tests.test_bad_inputs import world as bad_inputs_world

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    """test_bad_inputs' world: a tiny chat target, its conversations, a finished precompute folder and a head."""
    return bad_inputs_world.__wrapped__(tmp_path_factory)


def one_error(res, prog: str) -> str:
    """The one `prog: error: ...` line of a refused run (exit 2, no traceback)."""
    errors = [line for line in res.err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert res.code == 2 and len(errors) == 1, (res.code, res.err[-3000:])
    assert "Traceback" not in res.err + res.out and "HYDRA_FULL_ERROR" not in res.err, res.err[-3000:]
    return errors[0]


def precompute_args(w: World, out: Path, data: Path | None = None) -> list[str]:
    return [f"model.path={w.target}", f"data.paths=[{data or w.data}]", f"out={out}", *PRECOMPUTE]


# --------------------------------------------------------------------------------------------- data paths


@pytest.mark.parametrize("kind", ["fifo", "dev-null", "dev-fd"])
def test_a_data_path_that_is_not_a_file_is_named(world, tmp_path, capsys, kind):
    fds: list[int] = []
    if kind == "fifo":
        path = tmp_path / "convs.jsonl"
        os.mkfifo(path)
        what = "a FIFO (named pipe)"
    elif kind == "dev-null":
        path, what = Path("/dev/null"), "a character device"
    else:
        fds = list(os.pipe())
        path, what = Path(f"/dev/fd/{fds[0]}"), "a FIFO (named pipe)"
    try:
        res = run_cli("precompute", precompute_args(world, tmp_path / "out", path), capsys)
    finally:
        for fd in fds:
            os.close(fd)
    line = one_error(res, "mtp-precompute")
    assert f"{path}: not a regular file: it is {what}" in line and "write the data to a file" in line, line
    assert not (tmp_path / "out").exists()


def test_a_garbage_parquet_is_named(world, tmp_path, capsys):
    bad = tmp_path / "chats.parquet"
    bad.write_bytes(bytes(range(256)) * 4)
    line = one_error(run_cli("precompute", precompute_args(world, tmp_path / "out", bad), capsys), "mtp-precompute")
    assert f"{bad}: not a readable parquet file" in line and "re-export the file" in line, line


# ------------------------------------------------------------------------------- arguments Hydra cannot read


@pytest.mark.parametrize("args, fragments", [
    (["data.system_prompt=What now? (be brief)"],
     ["argument 'data.system_prompt=What now? (be brief)' is not a setting Hydra can read",
      "quote the value: \"data.system_prompt='What now? (be brief)'\""]),
    (["out={tmp}/my", "run"],  # `out={tmp}/my run` unquoted: the shell made two arguments
     ["argument 'run' is not a setting Hydra can read", "quote the whole value: \"out='{tmp}/my run'\""]),
    (["data.system_prompt=line one\nline two"],
     ["argument 'data.system_prompt=line one\\nline two'", "quote the value: $'data.system_prompt=\\'line one\\nline "
                                                           "two\\''"]),
    (["data.paths=[{tmp}/a.jsonl"],
     ["argument 'data.paths=[{tmp}/a.jsonl'", "close the list with ]"]),
    (["data.paths=[{tmp}/caf\udce9.jsonl]"],
     ["argument 'data.paths=[{tmp}/caf\\udce9.jsonl]' holds a byte that is not UTF-8 (\\xe9 at character",
      "rename the file or folder to a UTF-8 name"]),
])
@pytest.mark.parametrize("module", ["precompute", "train"])
def test_an_argument_hydra_cannot_read_is_named_with_how_to_quote_it(world, tmp_path, capsys, module, args,
                                                                      fragments):
    base = precompute_args(world, tmp_path / "out") if module == "precompute" else \
        [f"model.path={world.target}", f"data.dir={world.pc}", f"out={tmp_path / 'out'}", *TRAIN]
    res = run_cli(module, base + [a.format(tmp=tmp_path) for a in args], capsys)
    line = one_error(res, f"mtp-{module}")
    for fragment in fragments:
        assert fragment.format(tmp=tmp_path) in line, (fragment, line)
    assert not (tmp_path / "out").exists() and not (tmp_path / "my").exists()


# ----------------------------------------------------------------------------------------------- repeated ids


def test_repeated_ids_get_new_ids_that_collide_with_none_and_are_named_by_file_and_line(world, tmp_path, capsys):
    data = _jsonl(tmp_path / "ids.jsonl", [{**_chat(0, "tea"), "id": "x"}, {**_chat(1, "owls"), "id": "x"},
                                           {**_chat(2, "maps"), "id": "x#2"}])
    out = tmp_path / "pc"
    res = run_cli("precompute", precompute_args(world, out, data), capsys)
    assert res.code == 0, res.err[-3000:]
    from safetensors import safe_open

    manifest = json.loads((out / "manifest.json").read_text())
    ids = []
    for shard in manifest["shards"]:
        with safe_open(str(out / shard["file"]), framework="pt") as f:
            ids += json.loads(f.metadata()["sample_ids"])
    assert sorted(ids) == ["x", "x#2", "x#3"]
    renamed = f"{data}:2: 'x' kept as 'x#3'"
    assert manifest["data"]["duplicate_id_rows"] == [renamed]
    assert renamed in res.out


# ------------------------------------------------------------------------------------------ the target's files


def _target_copy(w: World, tmp: Path) -> Path:
    target = tmp / "target"
    shutil.copytree(w.target, target)
    return target


@pytest.mark.parametrize("damage, fragments", [
    (lambda t: (t / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }"),
     ["target/chat_template.jinja: the chat template does not parse: unexpected '}' at line 1 of the template"]),
    (lambda t: (t / "tokenizer.json").unlink(),
     ["target/tokenizer.json is missing", "copy the target's tokenizer.json"]),
    (lambda t: (t / "tokenizer_config.json").write_text('{"model_max_length": 8,\n  "chat_template": }'),
     ["target/tokenizer_config.json: invalid JSON at line 2 column", "restore the file"]),
], ids=["broken-template", "missing-tokenizer-json", "malformed-tokenizer-config"])
def test_a_broken_tokenizer_or_template_is_blamed_on_its_file(world, tmp_path, capsys, damage, fragments):
    target = _target_copy(world, tmp_path)
    damage(target)
    args = [f"model.path={target}", *precompute_args(world, tmp_path / "out")[1:]]
    line = one_error(run_cli("precompute", args, capsys), "mtp-precompute")
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert f"{world.data}:" not in line  # no data row is blamed


# ------------------------------------------------------------------------------------------ no room to write


def test_a_full_disk_at_the_write_seam_names_the_folder_and_the_bytes(tmp_path):
    """ENOSPC met inside `atomic_write`: DiskFullError naming the folder, the file, the bytes it needs; the file
    that was there is untouched and no temporary is left. The ENOSPC is the kernel's, from /dev/full; where a
    container has no /dev/full, the writer raises the OSError a full disk gives."""
    dest = tmp_path / "run" / "report.json"
    atomic_write_text(dest, "old\n")
    payload = b"x" * 10_000
    has_dev_full = stat.S_ISCHR(os.stat("/dev/full").st_mode) if os.path.exists("/dev/full") else False

    def into_full_disk(tmp: Path) -> None:
        tmp.write_bytes(payload[:100])
        if not has_dev_full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        with open("/dev/full", "wb", buffering=0) as full:
            full.write(payload)

    with pytest.raises(DiskFullError) as caught:
        atomic_write(dest, into_full_disk, size=len(payload))
    msg = str(caught.value)
    assert msg.startswith(f"no space left on the device of {dest.parent} (") and "free)" in msg, msg
    assert "writing report.json needs 9.8 KiB (10000 bytes)" in msg and "re-run the same command" in msg, msg
    assert dest.read_text() == "old\n" and sorted(p.name for p in dest.parent.iterdir()) == ["report.json"]


def _cli(module: str, args: list[str], *, fsize: int | None = None, interrupt_at: str | None = None,
         ) -> subprocess.CompletedProcess:
    """`mtp-<module> args` in a subprocess (native CPU kernels off: nothing is compiled under the limit).

    fsize: a file size limit (RLIMIT_FSIZE) for the process; interrupt_at: SIGINT is raised at the first rename
    onto a file of that name (an audit hook on `os.replace`), a fixed point of the run instead of a moment."""
    prelude = ""
    if interrupt_at:
        prelude = textwrap.dedent(f"""
            import signal
            fired = []
            def hook(event, args):
                if event == "os.rename" and not fired and str(args[1]).endswith({interrupt_at!r}):
                    fired.append(1)
                    signal.raise_signal(signal.SIGINT)
            sys.addaudithook(hook)
        """)
    code = (f"import sys\n{prelude}\nfrom mtp_train.cli.{module} import main\n"
            f"sys.argv = {[f'mtp-{module}', *args]!r}\nmain()\n")

    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = {**os.environ, "PYTHONPATH": str(ROOT), "MTP_TRAIN_CPU_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          preexec_fn=limit, timeout=600)


def _lines(proc: subprocess.CompletedProcess, prefix: str) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith(prefix)]


def _shards(out: Path) -> dict[str, bytes]:
    """The shards and sidecars of a precompute folder, and its manifest's list of them (the rest of the manifest
    names the folder and the time)."""
    files = {k: v for k, v in tree(out).items() if k.startswith("shard-")}
    return {**files, "manifest.json shards": json.dumps(json.loads((out / "manifest.json").read_text())["shards"])}


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted subprocess runs of precompute and train, to compare resumed runs with."""
    root = tmp_path_factory.mktemp("reference")
    pc, run = root / "pc", root / "run"
    assert _cli("precompute", precompute_args(world, pc)).returncode == 0
    res = _cli("train", [f"model.path={world.target}", f"data.dir={world.pc}", f"out={run}", *TRAIN,
                         "train.save_every=1"])
    assert res.returncode == 0, res.stderr[-3000:]
    return {"pc": pc, "run": run}


def test_precompute_past_the_file_size_limit_is_one_line_and_resumes_exactly(world, tmp_path, reference):
    out = tmp_path / "pc"
    limited = _cli("precompute", precompute_args(world, out), fsize=4000)  # the tiny shards are 2.6-4.8 KB
    errors = _lines(limited, "mtp-precompute: error: ")
    assert limited.returncode == 2 and len(errors) == 1, limited.stderr[-3000:]
    assert f"into {out} needs" in errors[0] and "over this process's file size limit (ulimit -f: 3.9 KiB (4000 " \
        "bytes))" in errors[0] and "re-run the same command" in errors[0], errors[0]
    kept = {k for k in tree(out) if k.endswith(".safetensors")}
    assert kept and not any(k.startswith(".tmp-") for k in tree(out))  # some shards done, no torn file
    assert _cli("precompute", precompute_args(world, out)).returncode == 0
    assert _shards(out) == _shards(reference["pc"])


def test_training_and_export_past_the_file_size_limit_are_one_line_and_training_resumes_exactly(world, tmp_path,
                                                                                                reference):
    run = tmp_path / "run"
    args = [f"model.path={world.target}", f"data.dir={world.pc}", f"out={run}", *TRAIN, "train.save_every=1"]
    limited = _cli("train", args, fsize=20_000)  # the optimiser state of a checkpoint is larger
    errors = _lines(limited, "mtp-train: error: ")
    assert limited.returncode == 2 and len(errors) == 1, limited.stderr[-3000:]
    assert "over this process's file size limit" in errors[0] and str(run) in errors[0], errors[0]
    assert _cli("train", args).returncode == 0
    head = "heads/step-2/model.safetensors"
    assert tree(run)[head] == tree(reference["run"])[head]

    out = tmp_path / "export"
    limited = _cli("export", [f"model.path={world.target}", f"head_ckpt={world.head}", f"out={out}"], fsize=4000)
    errors = _lines(limited, "mtp-export: error: ")
    assert limited.returncode == 2 and len(errors) == 1, limited.stderr[-3000:]
    assert f"writing model.safetensors into {out} needs" in errors[0], errors[0]


# ---------------------------------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_in_precompute_says_where_it_stopped_and_a_re_run_finishes_exactly(world, tmp_path, reference):
    out = tmp_path / "pc"
    stopped = _cli("precompute", precompute_args(world, out), interrupt_at="shard-r0-00002.safetensors")
    lines = _lines(stopped, "mtp-precompute: interrupted ")
    assert stopped.returncode == 2 and len(lines) == 1, stopped.stderr[-3000:]
    assert f"of 6 shards were written to {out}; re-run the same command to go on from there" in lines[0], lines[0]
    assert "KeyboardInterrupt" not in stopped.stderr and not (out / "manifest.json").exists()
    assert _cli("precompute", precompute_args(world, out)).returncode == 0
    assert _shards(out) == _shards(reference["pc"])


def test_ctrl_c_in_training_says_where_it_stopped_and_a_re_run_resumes_exactly(world, tmp_path, reference):
    run = tmp_path / "run"
    args = [f"model.path={world.target}", f"data.dir={world.pc}", f"out={run}", *TRAIN, "train.save_every=1"]
    stopped = _cli("train", args, interrupt_at="step-2/state.json")  # while the second checkpoint is written
    lines = _lines(stopped, "mtp-train: interrupted ")
    assert stopped.returncode == 2 and len(lines) == 1, stopped.stderr[-3000:]
    assert f"at step 2 of 2; re-run the same command to resume from its last checkpoint, {run}/checkpoints/step-1" \
        in lines[0], lines[0]
    assert "KeyboardInterrupt" not in stopped.stderr
    assert _cli("train", args).returncode == 0
    head = "heads/step-2/model.safetensors"
    assert tree(run)[head] == tree(reference["run"])[head]
