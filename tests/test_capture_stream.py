"""`mtp-precompute backend=vllm` streams its input: through running servers (`tests.test_capture`'s stand-in for a
`vllm serve` with our connector), the first shard is written after a few windows of conversations were read and
tokenized, not the whole file, and it holds the first conversations in order."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from mtp_train.capture.layers import layer_map
from mtp_train.data.chat import load_tokenizer
from mtp_train.data.samples import SampleStream
from mtp_train.precompute.vllm_backend import precompute_vllm
from tests.conftest import TOPICS, write_jsonl
from tests.test_capture import (  # noqa: F401 (target: the fixture, shared)
    AUX,
    LAYERS,
    _CapturingServer,
    _endpoint_cfg,
    target,
)

pytestmark = pytest.mark.usefixtures("one_thread")


class _Stop(Exception):
    pass


def _chat(i: int) -> dict:
    t = TOPICS[i % len(TOPICS)]
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about {t}."},
                                        {"role": "assistant", "content": f"Here is a fact about {t}."}]}


def test_first_shard_is_written_after_a_few_windows_not_the_whole_input(target, tmp_path):  # noqa: F811
    n, window = 5_000, 32
    data = write_jsonl(tmp_path / "big.jsonl", [_chat(i) for i in range(n)])
    spool = tmp_path / "shared"
    with _CapturingServer(target, spool, layer_map(AUX, LAYERS).vllm_ids) as server:
        cfg = _endpoint_cfg(target, data, tmp_path / "pc", spool, server.url)
        cfg.max_seq_len, cfg.shard_tokens, cfg.window = 64, 600, window
        stream = SampleStream(load_tokenizer(target), cfg, window=window)
        tokenized_at: list[int] = []

        def first_shard(info, skipped) -> None:
            tokenized_at.append(stream.tokenized)
            raise _Stop  # the run stops here; a re-run would keep the shard

        with pytest.raises(_Stop):
            precompute_vllm(cfg, environ={}, config_dict={}, stream=stream, on_shard=first_shard)
    first = tmp_path / "pc" / "shard-r0-00000.safetensors"
    with safe_open(str(first), "pt") as f:
        ids = json.loads(f.metadata()["sample_ids"])
    assert ids == [f"c{i}" for i in range(len(ids))] and len(ids) > 1
    # The conversations are sent a window at a time, a shard converted once a window is planned after it, and the
    # stream tokenizes a window ahead of the plans: what was read is bounded by the window, not the input's size.
    assert len(tokenized_at) == 1 and tokenized_at[0] <= 4 * window < n
    assert stream.info == {}  # the stream never reached its end
