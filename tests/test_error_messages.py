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
import signal
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
        # Python installs its Ctrl-C handler only where SIGINT is not ignored, as it is under a runner started as
        # a background job of a non-interactive shell.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

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
    assert f" shards were written to {out}; re-run the same command to go on from there" in lines[0], lines[0]
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


# ----------------------------------------------------- records Python cannot hold, configs that do not compose


def _listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """An empty working folder for the command, whose listing a test compares after the run."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


@pytest.mark.parametrize("row, fragment", [
    ('{"id": "deep", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
     ":2: nested_too_deep: nested deeper than 100 levels (arrays and objects 100001 deep); flatten the record"),
    ('{"id": ' + "9" * 5001 + ', "prompt": "hi"}',
     ":2: integer_too_long: field id is an integer of 5001 digits, more than the 4300 Python converts; write it as a "
     "string"),
], ids=["nested-100k-deep", "id-of-5001-digits"])
def test_a_record_python_cannot_hold_is_a_bad_row_and_skip_skips_it(world, tmp_path, capsys, work, row, fragment):
    data = _jsonl(tmp_path / "odd.jsonl", [_chat(0, "tea"), row, _chat(2, "owls")])
    out = tmp_path / "pc"
    res = run_cli("precompute", precompute_args(world, out, data), capsys)
    assert one_error(res, "mtp-precompute") == f"mtp-precompute: error: {data}{fragment}" + \
        one_error(res, "mtp-precompute").split(fragment, 1)[1]
    assert res.err.strip().count("\n") == 0 and not out.exists()
    res = run_cli("precompute", precompute_args(world, out, data) + ["data.on_bad_row=skip"], capsys)
    assert res.code == 0, res.err[-3000:]
    reason = fragment.split(": ")[1]
    assert json.loads((out / "manifest.json").read_text())["data"]["bad_rows"] == {reason: 1}
    assert f"1 bad row(s) skipped ({reason}=1)" in res.out and f"{data}:2" in res.out
    assert _listing(work) == []


def _user_configs(tmp: Path) -> Path:
    """A folder of the user's configs: links to a text that is no config and to a binary, broken YAML, a link to
    nothing, and a good copy of conf/export.yaml without its `hydra:` settings."""
    folder = tmp / "cfg"
    folder.mkdir()
    secret = tmp / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")
    (folder / "evil.yaml").symlink_to(secret)
    (folder / "binary.yaml").symlink_to(sys.executable)
    (folder / "broken.yaml").write_text("format: [native\nout: x\n")
    (folder / "gone.yaml").symlink_to(tmp / "nothing-here")
    own = (ROOT / "conf" / "export.yaml").read_text().split("\nhydra:")[0]
    (folder / "mine.yaml").write_text("\n".join(line for line in own.splitlines()
                                                if "override hydra/" not in line and "- model:" not in line))
    return folder


@pytest.mark.parametrize("name, fragments", [
    ("evil", ["evil.yaml: a top-level key of 79 characters that is not a setting name",
              "pass one shaped like conf/export.yaml"]),
    ("binary", ["binary.yaml (or a config its defaults list names) is not UTF-8 text"]),
    ("broken", ["broken.yaml: not YAML that can be read: ", "at line 2, column 4", "fix the file"]),
    ("gone", ["gone.yaml: no such file (or a link to none); check --config-path and --config-name"]),
])
def test_a_config_of_the_users_that_does_not_compose_is_one_line_naming_the_file_not_its_content(
        tmp_path, capsys, work, name, fragments):
    folder = _user_configs(tmp_path)
    res = run_cli("export", ["--config-path", str(folder), "--config-name", name], capsys)
    line = one_error(res, "mtp-export")
    assert res.err.strip() == line and str(folder) in line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert "root:" not in res.err + res.out and "nologin" not in res.err + res.out
    assert _listing(work) == []


def test_a_config_of_the_users_runs_with_nothing_of_hydras_in_the_working_folder(tmp_path, capsys, work):
    # Its run folder, .hydra copy and job log would go to ./outputs/<date>/<time>/ by Hydra's defaults.
    folder = _user_configs(tmp_path)
    res = run_cli("export", ["--config-path", os.path.relpath(folder, work), "--config-name", "mine",
                             f"head_ckpt={tmp_path / 'no-head'}", f"out={tmp_path / 'out'}"], capsys)
    assert one_error(res, "mtp-export").endswith(f"{tmp_path / 'no-head'} is not a head checkpoint (see save_head)")
    assert _listing(work) == []


@pytest.mark.parametrize("args, fragment", [
    (["-m"], "-m/--multirun (a Hydra sweep) is not supported: each run writes one `out`: run the command once per "
             "setting, each with its own out="),
    (["hydra.mode=MULTIRUN"], "hydra.mode=MULTIRUN (a Hydra sweep) is not supported"),
    (["format=native,deepseek-mtp"], "argument 'format=native,deepseek-mtp' is a sweep (one run per value), which "
                                     "is not supported: give a list as key=[a,b]"),
    (["--experimental-rerun", "config.pickle"], "--experimental-rerun is not supported (it loads a pickle)"),
], ids=["-m", "hydra.mode", "sweep-value", "rerun-pickle"])
def test_a_sweep_is_refused_in_one_line_and_leaves_the_working_folder_as_it_was(world, tmp_path, capsys, work,
                                                                                 args, fragment):
    res = run_cli("export", [f"head_ckpt={world.head}", f"out={tmp_path / 'out'}", *args], capsys)
    assert fragment in one_error(res, "mtp-export")
    assert res.err.strip().count("\n") == 0
    assert _listing(work) == [] and not (tmp_path / "out").exists()
