"""Generating through OpenAI-compatible servers: a fleet of `vllm serve` / `mtp-serve` / SGLang endpoints, or a
router in front of them, as a `Generator` (`mtp_train.engine.generator`).

`generator.OpenAIGenerator` sends each request's prompt as token ids to `/v1/completions` with vLLM's
`return_token_ids` (so the rows are exactly what our rendering and loss masks see, and the answer comes back as the
ids the model produced, its stop token included), spreading a batch over the endpoints with a number of requests in
flight per endpoint, checking every answer (token ids, length, finish reason), and retrying 429 / 5xx / timeouts /
dropped connections on any endpoint while a failing one probes after its own backoff and is dropped once it has
failed for `dead_after` seconds (`health`, `http`). Before a run, `check_template` asks each server to render a few
conversations through `/v1/chat/completions` and refuses, at the first differing token, a server whose chat template
disagrees with ours.
"""

from mtp_train.remote.generator import OpenAIGenerator
from mtp_train.remote.http import RemoteError

__all__ = ["OpenAIGenerator", "RemoteError"]
