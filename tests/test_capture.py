"""Stage one through vLLM without vLLM: the layer numbering, the connector's request bookkeeping, capture files,
and the driver turning capture files into the very shards our engine writes (resume and errors included).

The capture files here are written from our own engine in vLLM's numbering (aux id i < L: the residual stream
before layer i; id L: the last layer's output before the final norm), exactly what the connector stores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mtp_train.capture import launch
from mtp_train.capture.book import RequestBook, Save, slots
from mtp_train.capture.layers import layer_map
from mtp_train.capture.saver import CaptureSaver
from mtp_train.capture.spool import file_name, read_capture, remove_torn, write_capture
from mtp_train.config import PrecomputeConfig
from mtp_train.config.data import DataConfig
from mtp_train.config.model import ModelConfig
from mtp_train.data.chat import load_tokenizer
from mtp_train.data.samples import build_samples, to_rows
from mtp_train.engine import prefill_hidden
from mtp_train.models import load_model
from mtp_train.precompute import PrecomputeError, folder_spec
from mtp_train.precompute.pipeline import run_precompute
from mtp_train.precompute.vllm_backend import capture_tag, precompute_vllm, rows_of, usable
from tests.conftest import make_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 3
AUX = [2, 0, 3]  # out of order, the embeddings, and L (after the final norm)


# --- layer numbering ------------------------------------------------------------------------------------------


def test_layer_map_asks_vllm_for_sorted_ids_and_normalises_its_last_layer():
    m = layer_map([27, 2, 30, 0, 15], 30)
    assert m.vllm_ids == (0, 2, 15, 27, 30)  # vLLM returns its aux states sorted
    assert m.hidden == (4, True)
    assert m.aux == ((3, False), (1, False), (4, True), (0, False), (2, False))
    assert layer_map([], 30).vllm_ids == (30,)  # the shard's `hidden` always needs id L
    with pytest.raises(ValueError, match="31"):
        layer_map([31], 30)


# --- request bookkeeping --------------------------------------------------------------------------------------


def test_book_names_captures_by_sample_and_hands_each_save_over_once():
    book = RequestBook()
    book.admit("r1", {"sample_id": "conv/1"})
    book.admit("r2", None)  # no sample id: the request id names it
    assert book.finish("r0", [1, 2], [5]) is None  # never scheduled: nothing computed, nothing held
    assert book.finish("r2", [7], [3]) == Save("r2", "r2", [7], [3])
    assert book.finish("r1", [4, 5, 6], [9, 2]) == Save("r1", "conv/1", [4, 5, 6], [9, 2])
    assert [s.req_id for s in book.take()] == ["r2", "r1"]
    assert book.take() == [] and book.samples == {}
    book.admit("r3", {"sample_id": "conv/2", "tag": "run-b"})  # a client of a running server names its run
    assert book.finish("r3", [1], [0]) == Save("r3", "conv/2", [1], [0], tag="run-b")


def test_slots_follow_the_block_table():
    assert slots([7, 2], 4, 6) == [28, 29, 30, 31, 8, 9]
    assert slots([3], 16, 0) == []
    with pytest.raises(ValueError, match="do not fit"):
        slots([1], 4, 5)


# --- capture files --------------------------------------------------------------------------------------------


def test_capture_file_round_trip_and_torn_temporaries(tmp_path):
    states = torch.randn(5, 2, 8)
    path = write_capture(tmp_path, "a/b c", torch.arange(5), states, [0, 3], tag="t1")
    assert path.name == file_name("a/b c") and file_name("a/b c") != file_name("a/b d")
    cap = read_capture(path)
    assert cap.sample_id == "a/b c" and cap.layer_ids == [0, 3]
    assert torch.equal(cap.hidden_states, states) and cap.token_ids.tolist() == list(range(5))
    (tmp_path / ".tmp-1-x.safetensors").write_bytes(b"torn")
    remove_torn(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# --- reading a request out of the capture cache ---------------------------------------------------------------


def _cache_and_saves(device: str) -> tuple[torch.Tensor, list[Save], list[torch.Tensor]]:
    """A (blocks, k, block_size, H) cache holding two requests in scattered blocks, and each one's (n, k, H) rows."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(6, 2, 4, 3, generator=g)
    saves = [Save("r1", "s1", [5, 6, 7, 8, 9], [4, 1]), Save("r2", "s2", [1, 2, 3], [2])]
    rows = [torch.stack([cache[4, :, t] if t < 4 else cache[1, :, t - 4] for t in range(5)]),
            torch.stack([cache[2, :, t] for t in range(3)])]
    return cache.to(device), saves, rows


def _check_saved(folder: Path, saves: list[Save], rows: list[torch.Tensor]) -> None:
    for save, want in zip(saves, rows):
        cap = read_capture(folder / file_name(save.sample_id))
        assert cap.token_ids.tolist() == save.token_ids and cap.layer_ids == [3, 7]
        assert torch.equal(cap.hidden_states, want)


def test_saver_on_cpu_writes_each_request_at_once(tmp_path):
    cache, saves, rows = _cache_and_saves("cpu")
    saver = CaptureSaver(tmp_path, [3, 7], "t", block_size=4)
    with pytest.raises(ValueError, match="expected"):
        saver.bind(cache[:, :1])  # one state per token where two were asked for
    saver.bind(cache)
    saves[1].tag = "asked"
    assert all(saver.save(s) for s in saves)  # written: the blocks may be freed now
    assert saver.poll() == set()
    _check_saved(tmp_path, saves, rows)
    tags = []
    for s in saves:
        with safe_open(str(tmp_path / file_name(s.sample_id)), "pt") as f:
            tags.append(f.metadata()["tag"])
    assert tags == ["t", "asked"]  # the connector's own tag unless the request named one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_saver_on_cuda_copies_without_blocking_then_writes(tmp_path):
    cache, saves, rows = _cache_and_saves("cuda")
    saver = CaptureSaver(tmp_path, [3, 7], "t", block_size=4)
    saver.bind(cache)
    assert not any(saver.save(s) for s in saves)  # in flight: reported by poll
    saver.close()  # the writer threads waited for the copies' events
    assert saver.poll() == {"r1", "r2"}
    _check_saved(tmp_path, saves, rows)


# --- the driver over capture files ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("capture") / "target", num_layers=LAYERS)


@pytest.fixture(scope="module")
def convs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("convs") / "convs.jsonl"
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about topic {i}."},
                                         {"role": "assistant", "content": "Here is a fact about it." * (1 + i % 3)}]}
            for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(target: Path, convs: Path, out: Path, **kw) -> PrecomputeConfig:
    return PrecomputeConfig(model=ModelConfig(path=str(target), dtype="float32", fetch=None),
                            data=DataConfig(paths=[str(convs)]), out=str(out), aux_layers=list(AUX),
                            hidden_dtype="float32", shard_tokens=120, val_fraction=0.0, progress=False, **kw)


def _vllm_states(model, ids: list[int], vllm_ids: tuple[int, ...]) -> torch.Tensor:
    """(n, k, H): what vLLM's cache-only layer holds for a prompt, from our engine (vLLM's numbering)."""
    last: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda mod, args, out: last.append(args[0]))
    try:
        out = prefill_hidden(model, [ids], hidden_layers=[i for i in vllm_ids if i < LAYERS])
    finally:
        hook.remove()
    by_id = {**out.layers, LAYERS: last.pop()}  # vLLM's id L: before the final norm
    return torch.stack([by_id[i] for i in vllm_ids], dim=1)


def _capture_like_vllm(cfg: PrecomputeConfig, spool: Path, ids: set[str] | None = None) -> None:
    """Write the capture files the connector would write for cfg's conversations (those in `ids`), from our engine."""
    model = load_model(cfg.model.path, dtype="float32", backend="torch")
    rows = to_rows(build_samples(load_tokenizer(cfg.model.path), cfg)[0], model.args.vocab_size)
    vllm_ids = layer_map(AUX, LAYERS).vllm_ids
    spec = folder_spec(model.args, torch.float32, cfg.model.path, "float32", AUX)
    for r in rows:
        if ids is None or r.id in ids:
            write_capture(spool, r.id, torch.from_numpy(r.ids), _vllm_states(model, r.ids.tolist(), vllm_ids),
                          list(vllm_ids), tag=capture_tag(spec.settings, vllm_ids))


def _tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    manifest = json.loads((folder / "manifest.json").read_text())
    out = {}
    for s in manifest["shards"]:
        with safe_open(str(folder / s["file"]), "pt") as f:
            out[s["file"]] = {k: f.get_tensor(k) for k in f.keys()} | {"ids": f.metadata()["sample_ids"]}  # noqa: SIM118
    return out


def _same_shards(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert list(ta) == list(tb) and len(ta) > 1
    for name in ta:
        assert ta[name]["ids"] == tb[name]["ids"]
        for key in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(ta[name][key], tb[name][key]), (name, key)
        for key in ("hidden", "aux_hidden"):
            torch.testing.assert_close(tb[name][key], ta[name][key], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def engine_folder(target, convs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine")
    cfg = _cfg(target, convs, out)
    model = load_model(target, dtype="float32", backend="torch")
    run_precompute(model, load_tokenizer(target), target, cfg, rank=0, world=1, tp_rank=0, tp_size=1,
                   config_dict={})
    return out


def test_captures_become_the_shards_our_engine_writes_and_a_rerun_resumes(target, convs, engine_folder, tmp_path):
    spool, out = tmp_path / "spool", tmp_path / "vllm"
    cfg = _cfg(target, convs, out, backend="vllm", vllm_python=sys.executable)
    cfg.vllm.spool_dir = str(spool)
    _capture_like_vllm(cfg, spool)
    precompute_vllm(cfg, environ={}, config_dict={})  # every capture is there: vLLM is not started
    _same_shards(engine_folder, out)
    assert not list(spool.glob("req-*"))  # a conversation's capture goes once its shard is on disk

    # Lose the second shard (and the manifest): a re-run keeps the first, captures only the second's conversations.
    manifest = json.loads((out / "manifest.json").read_text())
    first, second = (out / s["file"] for s in manifest["shards"][:2])
    kept = first.stat().st_mtime_ns
    second.unlink()
    (out / "manifest.json").unlink()
    with safe_open(str(engine_folder / second.name), "pt") as f:
        lost = set(json.loads(f.metadata()["sample_ids"]))
    _capture_like_vllm(cfg, spool, lost)
    precompute_vllm(cfg, environ={}, config_dict={})
    _same_shards(engine_folder, out)
    assert first.stat().st_mtime_ns == kept


def test_a_capture_of_other_settings_is_not_used(target, convs, tmp_path):
    cfg = _cfg(target, convs, tmp_path / "out")
    tok = load_tokenizer(target)
    row = to_rows(build_samples(tok, cfg)[0], len(tok))[0]
    path = write_capture(tmp_path, row.id, torch.from_numpy(row.ids), torch.zeros(row.ids.size, 1, 4), [3], tag="a")
    assert usable(path, "a", row)
    assert not usable(path, "b", row)  # other layers, weights or storage
    short = to_rows(build_samples(tok, cfg)[0], len(tok))[1]
    assert not usable(path, "a", short)  # another conversation's
    # Other token ids than our rendering (a server-side template, say) are refused with the first differing position.
    ids = torch.from_numpy(row.ids).clone()
    ids[2] += 1
    cap = read_capture(write_capture(tmp_path, row.id, ids, torch.zeros(row.ids.size, 1, 4), [LAYERS], tag="a"))
    with pytest.raises(PrecomputeError, match="first difference at position 2"):
        rows_of(cap, row, layer_map([], LAYERS), lambda x: x)


def test_missing_captures_start_vllm_and_its_failures_are_one_line(target, convs, tmp_path):
    cfg = _cfg(target, convs, tmp_path / "out", backend="vllm", vllm_python=str(tmp_path / "none" / "python"))
    with pytest.raises(PrecomputeError, match=r"vllm_python=.*no such file"):
        precompute_vllm(cfg, environ={}, config_dict={})
    # This environment's python has no vLLM: the child reports that, and the run says so.
    cfg.vllm_python = sys.executable
    with pytest.raises(PrecomputeError, match="cannot import vLLM") as e:
        precompute_vllm(cfg, environ={"PATH": "/usr/bin:/bin"}, config_dict={})
    assert "\n" not in str(e.value)
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg.vllm.spool_dir = str(blocker / "capture")
    with pytest.raises(PrecomputeError, match="capture folder .* is not writable"):
        precompute_vllm(cfg, environ={}, config_dict={})


def test_vllm_errors_are_said_in_their_informative_line():
    pydantic = ("ValidationError: 1 validation error for ModelConfig\n  Value error, Model architectures ['NoSuch'] "
                "are not supported for now. Supported architectures: dict_keys(['A', 'B']) [type=value_error]\n"
                "    For further information visit https://errors.pydantic.dev")
    assert launch.error_line(pydantic) == "Model architectures ['NoSuch'] are not supported for now."
    assert launch.error_line("RuntimeError: out of memory\nmore") == "RuntimeError: out of memory"
    assert launch.error_line("x" * 300).endswith("…") and len(launch.error_line("x" * 300)) == 240
    assert launch.error_line("") == ""


def test_the_vllm_process_sees_only_the_capture_modules(tmp_path):
    root = launch.stage_modules(tmp_path)
    staged = sorted(str(p.relative_to(root / "mtp_train")) for p in (root / "mtp_train").rglob("*.py"))
    assert staged == sorted(launch.CHILD_MODULES)
    env = launch.child_env({"PYTHONPATH": "/elsewhere", "HOME": "/h"}, root, 3)
    assert env == {"PYTHONPATH": str(root), "HOME": "/h", "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert launch.child_env({"VLLM_CPU_KVCACHE_SPACE": "8"}, root, 3)["VLLM_CPU_KVCACHE_SPACE"] == "8"
    # The modules vLLM imports import nothing else of ours (it runs where our package is not installed).
    for rel in launch.CHILD_MODULES:
        text = (root / "mtp_train" / rel).read_text()
        ours = {line.split()[1] for line in text.splitlines()
                if line.startswith(("from mtp_train", "import mtp_train"))}
        assert ours <= {"mtp_train.capture.book", "mtp_train.capture.saver", "mtp_train.capture.spool"}, rel


def test_command_line_backend_errors_are_one_line(target, convs, tmp_path):
    base = [sys.executable, "-m", "mtp_train.cli.precompute", f"out={tmp_path / 'x'}", f"model.path={target}",
            "model.fetch=null", f"data.paths=[{convs}]"]
    for extra, said in ((["backend=vllm", f"vllm_python={tmp_path / 'none'}"], "vllm_python="),
                        (["backend=vlm"], "backend='vlm'")):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()  # refused before anything was written


def test_vllm_side_takes_prompts_a_part_at_a_time_with_our_connector():
    from mtp_train.capture import vllm_run

    def part(ids: range) -> str:
        return json.dumps([{"id": f"s{i}", "token_ids": [i]} for i in ids]) + "\n"

    lines = iter([part(range(2)), "\n", part(range(2, 5)), "[]\n", part(range(5, 6))])
    parts = vllm_run.parts(lines)
    # Each part is handed over as soon as its line is read (the driver is still reading the data behind it).
    assert [p["id"] for p in next(parts)] == ["s0", "s1"] and next(lines) == "\n"
    assert [[p["id"] for p in c] for c in parts] == [["s2", "s3", "s4"], ["s5"]]
    args = vllm_run.engine_args({"model": "m", "max_model_len": 9, "layer_ids": [2, 30], "spool_dir": "d",
                                 "tag": "t", "engine": {"max_num_seqs": 3}})
    assert args["enable_prefix_caching"] is False  # a cached prefix would never reach the capture cache
    assert args["speculative_config"]["method"] == "extract_hidden_states"
    assert args["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30]
    kv = args["kv_transfer_config"]
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == ("MtpCaptureConnector",
                                                                    "mtp_train.capture.vllm_connector")
    assert kv["kv_connector_extra_config"] == {"spool_dir": "d", "tag": "t"} and args["max_num_seqs"] == 3


def test_check_vllm_capture_flags_a_shifted_layer_and_a_changed_mask(engine_folder, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from checks.check_vllm_capture import compare

    assert compare(engine_folder, engine_folder, AUX)["errors"] == {"hidden": 0.0, "aux 2": 0.0, "aux 0": 0.0,
                                                                     "aux 3": 0.0}
    other = tmp_path / "other"
    shutil.copytree(engine_folder, other)
    name = json.loads((other / "manifest.json").read_text())["shards"][0]["file"]
    tensors = load_file(other / name)
    with safe_open(str(other / name), "pt") as f:
        meta = f.metadata()
    h = tensors["hidden"].shape[1]
    tensors["aux_hidden"][:, :h] = tensors["aux_hidden"][:, h:2 * h]  # aux 2 holds aux 0's states
    tensors["loss_mask"][0] ^= 1
    save_file(tensors, other / name, metadata=meta)
    found = compare(engine_folder, other, AUX)
    assert found["errors"]["aux 2"] > 0.1 and found["errors"]["aux 0"] == 0.0
    assert found["same"]["loss_mask"] is False and found["same"]["input_ids"] is True


# --- through running servers (vllm.endpoints) -------------------------------------------------------------------


class _CapturingServer:
    """A stand-in for a running `vllm serve` with our connector (vLLM is not in this environment): `/v1/models`,
    and `/v1/completions` that prefills the prompt's token ids with our engine and writes the capture file the
    connector would (named by `kv_transfer_params`, its tag taken from them), answering with `capture_file`.

    Args:
        target: the model folder it serves.
        spool: where it writes.
        layer_ids: the vLLM ids it captures (its --speculative-config).
        connector: False: a plain server (answers, captures nothing).
    """

    def __init__(self, target: Path, spool: Path, layer_ids: tuple[int, ...], connector: bool = True) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.model = load_model(target, dtype="float32", backend="torch")
        self.requests = 0
        lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _json(self, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._json({"object": "list", "data": [{"id": "tiny", "root": str(target), "max_model_len": 512}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ids, kv = [int(t) for t in body["prompt"]], body.get("kv_transfer_params") or {}
                answer = {"choices": [{"index": 0, "text": "", "token_ids": [0], "prompt_token_ids": ids,
                                       "finish_reason": "length"}]}
                if connector:
                    with lock, torch.inference_mode():
                        server.requests += 1
                        states = _vllm_states(server.model, ids, layer_ids)
                        path = write_capture(spool, kv["sample_id"], torch.tensor(ids), states, list(layer_ids),
                                             tag=kv.get("tag", ""))
                    answer["kv_transfer_params"] = {"capture_file": f"/on/the/server/{path.name}"}
                self._json(answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _CapturingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _endpoint_cfg(target: Path, convs: Path, out: Path, spool: Path, url: str) -> PrecomputeConfig:
    cfg = _cfg(target, convs, out, backend="vllm", vllm_python=str(out / "no-vllm-here"))
    cfg.vllm.endpoints, cfg.vllm.spool_dir, cfg.vllm.concurrency = [url], str(spool), 2
    cfg.vllm.capture_timeout, cfg.vllm.retries = 5.0, 1
    return cfg


def test_capture_through_a_running_server_gives_our_shards(target, convs, engine_folder, tmp_path):
    spool = tmp_path / "shared"
    with _CapturingServer(target, spool, layer_map(AUX, LAYERS).vllm_ids) as server:
        manifest = precompute_vllm(_endpoint_cfg(target, convs, tmp_path / "out", spool, server.url), environ={},
                                   config_dict={})
        assert server.requests == 6 + 1  # each conversation once, and the probe
    _same_shards(engine_folder, tmp_path / "out")
    assert not list(spool.glob("req-*"))  # every capture went into a shard, the probe's included
    served = manifest.provenance["settings"]["servers"]
    assert served["endpoints"] == [server.url] and served["served_model"] == "tiny"
    assert served["weights_fingerprint"]  # the served weights folder is on this machine


def test_a_server_that_cannot_capture_for_the_run_is_refused_by_name(target, convs, tmp_path):
    spool = tmp_path / "shared"
    cases = [(dict(connector=False), "does not capture hidden states"),
             (dict(layer_ids=(0, 1, 3)), r"captures vLLM layers \[0, 1, 3\]; this run needs \[0, 2, 3\]"),
             (dict(spool=tmp_path / "elsewhere"), "did not appear in vllm.spool_dir")]
    for n, (kw, said) in enumerate(cases):
        args = dict(target=target, spool=spool, layer_ids=layer_map(AUX, LAYERS).vllm_ids) | kw
        with _CapturingServer(**args) as server:
            cfg = _endpoint_cfg(target, convs, tmp_path / f"out{n}", spool, server.url)
            cfg.vllm.capture_timeout = 0.2  # the file never comes: how long to look for it
            with pytest.raises(PrecomputeError, match=said) as e:
                precompute_vllm(cfg, environ={}, config_dict={})
            assert server.url in str(e.value) and "\n" not in str(e.value)
            assert server.requests <= 1  # refused at the probe: nothing else was sent
    with pytest.raises(PrecomputeError, match="unreachable"):
        precompute_vllm(_endpoint_cfg(target, convs, tmp_path / "out9", spool, "http://127.0.0.1:9"), environ={},
                        config_dict={})


def test_serve_command_and_endpoint_settings_on_the_command_line(target, convs, tmp_path):
    import shlex

    base = [sys.executable, "-m", "mtp_train.cli.precompute", f"out={tmp_path / 'x'}", f"model.path={target}",
            "model.fetch=null", f"data.paths=[{convs}]", "backend=vllm", "aux_layers=[2,0,3]"]
    r = subprocess.run(base + ["vllm.endpoints=[http://127.0.0.1:9]"], capture_output=True, text=True)
    assert r.returncode == 2 and "vllm.spool_dir" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    spool = tmp_path / "shared"
    r = subprocess.run(base + [f"vllm.spool_dir={spool}", "vllm.serve_command=true", "model.dtype=float32"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = next(t for t in r.stdout.splitlines() if t.startswith("PYTHONPATH="))
    words = shlex.split(line)
    flags = dict(zip(words[4::2], words[5::2])) | {w: "" for w in words if w in ("--no-enable-prefix-caching",)}
    assert words[0] == f"PYTHONPATH={spool / '.modules'}" and words[2:4] == ["-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(flags["--speculative-config"])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert json.loads(flags["--kv-transfer-config"])["kv_connector_extra_config"]["spool_dir"] == str(spool)
    assert flags["--dtype"] == "float32" and "--no-enable-prefix-caching" in flags
    staged = sorted(str(p.relative_to(spool / ".modules" / "mtp_train")) for p in spool.rglob("*.py"))
    assert staged == sorted(launch.CHILD_MODULES)
    assert not (tmp_path / "x").exists()
