"""`mtp-serve`: our engine behind an OpenAI-compatible HTTP server.

    mtp-serve model=smollm2-135m port=8000
    mtp-serve head_ckpt=runs/train/heads/step-2000 k=3          # speculative decoding with a trained head
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Binds its port first (a port another process holds is an error, exit 2, before any weights are read), loads the
target (and the head), starts the engine's thread, then serves until interrupted; prints one line
`mtp-serve: serving <id> on http://host:port` once it listens. See `mtp_train.serve`.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from mtp_train.cli.common import ensure_model, hydra_entry, load_target
from mtp_train.config import ServeConfig, check_config, head_type, resolve_device, typed
from mtp_train.engine.llm import LLMEngine
from mtp_train.engine.turns import stop_token_ids

log = logging.getLogger(__name__)
PROG = "mtp-serve"


def build_server(sc: ServeConfig) -> tuple[Any, Any]:
    """(app, worker) for a typed config: the target (and head) loaded, the worker not yet started."""
    from mtp_train.serve import EngineWorker, ServedModel, ServeLimits, build_app
    from mtp_train.serve.template import served_template_kwargs

    ensure_model(sc.model)
    model, tokenizer, path = load_target(sc.model, resolve_device(sc.model.device))
    engine_kw = dict(page_size=sc.model.page_size, kv_cache_gb=sc.model.kv_cache_gb,
                     max_batch_size=sc.max_batch_size)
    if sc.head_ckpt:
        from mtp_train.heads import load_head
        from mtp_train.speculative.engine import SpecEngine

        head = load_head(sc.head_ckpt, path, device=model.device, dtype=model.dtype, backend=sc.model.backend,
                         verify_fingerprint=sc.verify_fingerprint)
        head.stream_weights(None if sc.head_weights == "fp32" else sc.head_weights)
        engine: LLMEngine = SpecEngine(model, head_type(head.cfg.type).drafter(head, {}), sc.k, **engine_kw)
    else:
        engine = LLMEngine(model, **engine_kw)
    # The head's own kwargs when none are set; a warning when the ones set differ (prompts unlike the trained ones).
    template_kwargs = served_template_kwargs(sc.head_ckpt, sc.chat_template_kwargs)
    served = ServedModel(model_id=sc.model_id, root=str(path.resolve()), tokenizer=tokenizer,
                         max_context=model.args.max_position_embeddings,
                         max_request_tokens=engine.scheduler.max_request_tokens,
                         stop_ids=stop_token_ids(tokenizer, model.args.eos_token_ids, template_kwargs),
                         default_max_tokens=sc.max_tokens, template_kwargs=template_kwargs,
                         limits=ServeLimits(max_body_bytes=sc.max_body_bytes, request_timeout=sc.request_timeout,
                                            max_header_bytes=sc.max_header_bytes,
                                            trust_request_chat_template=sc.trust_request_chat_template))
    worker = EngineWorker(engine, vocab_size=model.args.vocab_size)
    return build_app(worker, served), worker


def serve_main(cfg: DictConfig) -> dict[str, Any]:
    """Run `mtp-serve` with a composed config until interrupted; return what it served."""
    import uvicorn

    from mtp_train.serve.http import bind, uvicorn_config

    sc = typed(check_config(cfg, "serve"), ServeConfig)
    sock = bind(sc.host, sc.port)  # before the weights load: a busy port is a one-line error at once
    try:
        app, worker = build_server(sc)
        worker.start()
        server = uvicorn.Server(uvicorn_config(app, sc.host, sc.port, sc.log_level))
        original_startup = server.startup
        port = sock.getsockname()[1]

        async def startup(sockets: Any = None) -> None:
            await original_startup(sockets)
            if server.started:
                print(f"{PROG}: serving {sc.model_id} on http://{sc.host}:{port}", flush=True)

        server.startup = startup  # type: ignore[method-assign]
        try:
            server.run(sockets=[sock])
        finally:
            worker.stop()
    finally:
        sock.close()
    return {"model": sc.model_id, **worker.describe()}


main = hydra_entry(PROG, "serve", serve_main)


if __name__ == "__main__":
    main()
