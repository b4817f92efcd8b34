"""`mtp-serve`: our engine (optionally speculative with a trained head) behind an OpenAI-compatible HTTP server.

`worker.EngineWorker` is the engine's one thread (requests batched by our scheduler), `app.build_app` the FastAPI
app over it (`/v1/models`, `/v1/chat/completions`, `/v1/completions`, streamed or not, vLLM's `return_token_ids`;
`/metrics`), `protocol` the request bodies, `text` the streamed answer text, `metrics` the Prometheus text,
`http` uvicorn's connections under the served model's limits.
The server library is FastAPI on uvicorn: the stack vLLM's and SGLang's OpenAI servers run on, so request
validation (pydantic) and streaming behave as clients of those servers expect.
"""

from mtp_train.serve.app import BadRequest, ServedModel, ServeLimits, build_app
from mtp_train.serve.worker import EngineWorker

__all__ = ["BadRequest", "EngineWorker", "ServeLimits", "ServedModel", "build_app"]
