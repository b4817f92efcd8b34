"""The regeneration client's own cost: is `generator=openai` ever the bottleneck of a fleet?

A local `mtp-serve` (its own process) serves the model; the client (`OpenAIGenerator`, as `mtp-regenerate
generator=openai` runs it) sends N requests of one prompt each at a given concurrency and asks for `--max-tokens`
tokens each (1 by default: the server's work per request is as small as it gets, so the client's share is as
large as it gets). Reported:

- requests_per_s: what the client and the server together sustained;
- client_cpu_ms_per_request: the client process's CPU time (user + system) per request, all of its threads;
- client_requests_per_cpu_s: requests one core of the client can drive (1000 / the above): the rate of a fleet
  one client process can feed before its own CPU limits it;
- client_cpu_share: the client's CPU time over the wall time (how busy one core of the client was).

Usage: python -m bench.remote --model models/smollm2-135m-instruct [--requests 256] [--concurrency 16]
The server's CPU time is its own; run on a quiet machine. The last line printed is one JSON object.
"""

from __future__ import annotations

import os
import resource
import sys
import time

from bench.common import ROOT, parser, report


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    from mtp_train import processes
    from mtp_train.engine.sampling import SamplingParams
    from mtp_train.remote.generator import OpenAIGenerator

    port = processes.free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "mtp_train.cli.serve", f"model.path={args.model}", "model.fetch=null",
            "model.dtype=float32", "model.device=cpu", f"port={port}", f"max_batch_size={args.concurrency}"]
    with processes.serving(argv, env, os.devnull, url, timeout=300.0, name="mtp-serve", every=0.1):
        gen = OpenAIGenerator.connect([url], concurrency=args.concurrency, timeout=600.0)
        prompts = [[(7 * i + j) % 1000 + 100 for j in range(args.prompt_tokens)] for i in range(args.requests)]
        params = [SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True, seed=i)
                  for i in range(args.requests)]
        gen.generate(prompts[:args.concurrency], params[:args.concurrency])  # warm both sides
        c0, t0 = _cpu_seconds(), time.perf_counter()
        outs = gen.generate(prompts, params)
        cpu, wall = _cpu_seconds() - c0, time.perf_counter() - t0
    assert len(outs) == args.requests and all(len(o.output_ids) == args.max_tokens for o in outs)
    res = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
           "requests_per_s": args.requests / wall, "client_cpu_ms_per_request": 1000 * cpu / args.requests,
           "client_requests_per_cpu_s": args.requests / cpu if cpu > 0 else None, "client_cpu_share": cpu / wall}
    print(f"{res['requests_per_s']:.1f} requests/s; the client: {res['client_cpu_ms_per_request']:.2f} ms CPU per "
          f"request ({res['client_requests_per_cpu_s']:.0f} requests per CPU second), busy "
          f"{res['client_cpu_share']:.0%} of the wall time", flush=True)
    report(res)
    return res


if __name__ == "__main__":
    main()
