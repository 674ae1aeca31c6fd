"""The README's first command (``make run`` runs ``python -m worker.demo``): an embedded Redis,
a worker on the default model, and the producer's chat jobs streamed and printed."""

import os
import re
import subprocess
import sys


def test_demo_runs_the_whole_service() -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # its own embedded Redis
    done = subprocess.run([sys.executable, "-m", "worker.demo", "--exit", "--max-tokens", "8"],
                          env=env | {"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert out.count("\n>>> ") == 4  # the first job streamed, then 3 answers (n=2 gives two)
    generated = re.search(r"3 jobs in [0-9.]+ s; engine: (\d+) tokens generated", out)
    assert generated and 4 <= int(generated[1]) <= 4 * 8  # 4 samples of at most 8 tokens
    assert "were held once, shared by its 2 samples" in out
    assert "rq-dashboard --redis-url redis://" in out
