"""Scale-out: a burst of jobs on one worker, then on two, alternating, on one private
redis-server. Each worker is a ``python -m worker`` process with one torch thread (this machine
has two cores: two workers can use both). The burst: --jobs jobs submitted at once, random
token-id prompts of [--min-prompt, --max-prompt] tokens, n cycling through --n (each sample
counts against a worker's --max-num-seqs), greedy, ignore_eos, --max-tokens each.

Prints per run the wall time from the submit to the last result, jobs per second, how the
jobs split between the workers (the RQ record's worker_name) and when each worker's last job
ended (its ``ended_at``, from the submit: the gap between them is the tail one worker ran
alone), then the ratio of the best
two-worker run to the best one-worker run, whether every job's tokens were the same in every
run (greedy), and the load average (above 2: other processes shared the cores).

    .venv/bin/python benchmarks/scale.py                 # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/scale.py --jobs 192 --repeats 3
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
# Python put this folder first on sys.path, where benchmarks/queue.py would shadow the standard
# library's queue (torch imports it): move the folder to the end.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from common import (  # noqa: E402  (first: it sets the environment torch reads at import)
    format_table,
    load_average,
    log,
    model_path,
    random_prompt,
    usable_token_ids,
)

from producer import Client  # noqa: E402
from producer.rq_mirror import WORKERS, job_key, parse_timestamp  # noqa: E402
from worker.redis_server import RedisServer  # noqa: E402

QUEUE = "scale"
ROOT = _HERE.parent


def spawn(url: str, model: Path, name: str, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "worker", "--redis-url", url, "--queue", QUEUE, "--model",
           str(model), "--dtype", "float32", "--device", "cpu", "--threads", "1",
           "--num-kv-blocks", str(args.kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
           "--consumer", name]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def run(url: str, model: Path, workers: int, specs: list[dict], args: argparse.Namespace,
        tag: str) -> tuple[float, Counter, dict[str, float], list[list[list[int]]]]:
    client = Client(url, queue=QUEUE, max_queue_len=None)
    client.redis.flushall()
    names = [f"{tag}-w{i}" for i in range(workers)]
    procs = [spawn(url, model, name, args) for name in names]
    try:
        while len(client.redis.smembers(WORKERS)) < workers:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a worker exited while starting")
            time.sleep(0.2)
        start, submitted = time.perf_counter(), time.time()
        handles = client.submit_many(specs)
        results = [h.result(timeout=600) for h in handles]
        seconds = time.perf_counter() - start
        records = [client.redis.hmget(job_key(h.id), "worker_name", "ended_at") for h in handles]
        split = Counter(name for name, _ in records)
        last_end: dict[str, float] = {}
        for name, ended in records:
            last_end[name] = max(last_end.get(name, 0.0), parse_timestamp(ended) - submitted)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(60)
        client.close()
    return seconds, split, last_end, [[o.token_ids for o in r.outputs] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mid")
    parser.add_argument("--jobs", type=int, default=96)
    parser.add_argument("--n", default="1,2,4,8", help="samples per job, cycled")
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = model_path(args.model)
    rng = np.random.default_rng(0)
    ids = usable_token_ids(model)
    ns = [int(n) for n in args.n.split(",")]
    specs = [{"prompt": random_prompt(rng, ids, int(rng.integers(args.min_prompt,
                                                                  args.max_prompt + 1))),
              "n": ns[i % len(ns)], "max_tokens": args.max_tokens, "temperature": 0.0,
              "ignore_eos": True} for i in range(args.jobs)]
    rows, best, outputs = [], {1: float("inf"), 2: float("inf")}, []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(data_dir=Path(tmp)).start()
        try:
            for repeat in range(args.repeats):
                for workers in (1, 2):
                    log(f"repeat {repeat}: {workers} worker(s)")
                    seconds, split, last_end, tokens = run(server.url, model, workers, specs,
                                                           args, f"r{repeat}n{workers}")
                    best[workers] = min(best[workers], seconds)
                    outputs.append(tokens)
                    rows.append([repeat, workers, round(seconds, 2),
                                 round(args.jobs / seconds, 1),
                                 " / ".join(str(c) for _, c in sorted(split.items())),
                                 " / ".join(f"{t:.2f}" for _, t in sorted(last_end.items()))])
        finally:
            server.stop()
    print(format_table(["repeat", "workers", "seconds", "jobs/s", "jobs per worker",
                        "last job ended (s)"], rows))
    same = all(o == outputs[0] for o in outputs)
    print(f"\n{args.jobs} jobs (n cycling {ns}, {args.max_tokens} tokens each, model "
          f"{args.model}): 2 workers / 1 worker = {best[1] / best[2]:.2f}x (best runs); "
          f"greedy tokens equal in every run: {same}; load average {load_average()}")


if __name__ == "__main__":
    main()
