"""``python -m worker.demo`` (``make run``): the whole service on one machine.

An embedded Redis (unless ``REDIS_URL`` is set), a worker with the default model on the CPU,
and a producer that submits a few chat jobs, one with n=2, streams the first one to the
terminal, then prints every answer and the engine's KV figures. It keeps serving afterwards so
that rq-dashboard can be opened on the same Redis (Ctrl-C stops), unless ``--exit``.
"""

import argparse
import logging
import os
import sys
import threading
import time

import structlog

from producer import Client
from worker.config import Settings
from worker.redis_server import embedded_redis_url
from worker.service import Worker

JOBS = [
    ("What is a paged KV cache? Answer in two sentences.", 1),
    ("Write a haiku about queues.", 2),  # n=2: both samples share the prompt's KV blocks
    ("Name three things Redis is used for.", 1),
]


def run_jobs(worker: Worker, client: Client, max_tokens: int) -> None:
    """Submits the demo's jobs, streams the first answer, prints the rest and the KV figures."""
    handles = [client.submit(messages=[{"role": "user", "content": question}], n=n,
                             max_tokens=max_tokens, temperature=0.7, top_p=0.9, seed=i)
               for i, (question, n) in enumerate(JOBS)]
    started = time.monotonic()
    print(f"\n>>> {JOBS[0][0]}")
    for event in handles[0].stream(timeout=600):  # the first answer, token by token
        if event.type == "chunk":
            print(event.text, end="", flush=True)
    print()
    for (question, _), handle in zip(JOBS[1:], handles[1:], strict=True):
        result = handle.result(timeout=600)
        for output in result.outputs:
            print(f"\n>>> {question} [sample {output.index}, {output.finish_reason}]\n"
                  f"{output.text.strip()}")
    stats = worker.engine.stats()
    print(f"\n{len(JOBS)} jobs in {time.monotonic() - started:.1f} s; engine: "
          f"{stats['tokens_generated']} tokens generated, KV blocks peak "
          f"{stats['kv_blocks_peak']} of {stats['kv_blocks_total']} "
          f"(utilisation at peak {stats['kv_utilization_at_peak']:.1%}), prefix-cache hits "
          f"{stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prompt tokens, "
          f"preemptions {stats['preemptions']}")
    shared = next(h.result(timeout=1) for h, (_, n) in zip(handles, JOBS, strict=True) if n > 1)
    assert shared.usage is not None  # a finished job's result carries its usage
    prompt, block_size = shared.usage.prompt_tokens, worker.engine.config.block_size
    n = len(shared.outputs)
    print(f"the n={n} job's {prompt}-token prompt: its {prompt // block_size} full blocks of "
          f"{block_size} were held once, shared by its {n} samples")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--exit", action="store_true", help="stop once the jobs are done")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    url, keep_alive = os.environ.get("REDIS_URL"), None
    if not url:
        url, keep_alive = embedded_redis_url()
    worker: Worker | None = None
    thread = threading.Thread()
    try:
        print(f"redis: {url}\nloading the default model (SmolLM2-135M-Instruct) on the CPU...")
        worker = Worker(Settings(redis_url=url, queue="demo", device="cpu", dtype="float32",
                                 grace_period=5))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        run_jobs(worker, Client(url, queue="demo"), args.max_tokens)
        print(f"\nrq-dashboard on this Redis: .venv/bin/rq-dashboard --redis-url {url} --json "
              "(then open http://127.0.0.1:9181); Ctrl-C stops", flush=True)
        while not args.exit:
            time.sleep(1)
    except KeyboardInterrupt:  # the normal way out: stop quietly, the worker first
        print("\nstopping", file=sys.stderr)
    finally:
        if worker is not None:
            worker.stop()  # its in-flight jobs get the grace period, while Redis is still up
            if thread.is_alive():
                thread.join(timeout=30)
        if keep_alive is not None and hasattr(keep_alive, "stop"):
            keep_alive.stop()  # also removes the embedded Redis' folder


if __name__ == "__main__":
    main()
