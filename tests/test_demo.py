"""The README's first command (``make run`` runs ``python -m worker.demo``): an embedded Redis,
a worker on the default model, and the producer's chat jobs streamed and printed; then a Ctrl-C
as a terminal sends it (to the whole process group) stops it quietly and leaves no folder."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def test_demo_runs_the_whole_service_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # its own embedded Redis
    # The demo takes Ctrl-C as a terminal's foreground job does. A test run from a background
    # job inherits SIGINT ignored (POSIX), and so would the demo: it slept on through the
    # signal, until CI's 60 s (session 69, pytest started by `nohup bash -c "... &"`). A handler
    # here, not SIG_IGN, leaves the demo's SIGINT at its default.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # PYTHONFAULTHANDLER: a demo that does not stop dumps its threads' stacks on SIGABRT
        demo = subprocess.Popen([sys.executable, "-m", "worker.demo", "--max-tokens", "8"],
                                env=env | {"HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path),
                                           "PYTHONFAULTHANDLER": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if before is None else before)
    lines = []
    try:
        for line in demo.stdout:
            lines.append(line)
            if "Ctrl-C stops" in line:
                break
        assert any(tmp_path.glob("pagedq-redis-*")), "the embedded Redis' folder"
        os.killpg(demo.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        try:
            rest, err = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # show where it hung
            os.killpg(demo.pid, signal.SIGABRT)
            err = demo.communicate(timeout=30)[1]
            pytest.fail(f"the demo did not stop within 60 s of Ctrl-C:\n{err[-8000:]}")
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 0, err[-4000:]
    out = "".join(lines) + rest
    assert out.count("\n>>> ") == 4  # the first job streamed, then 3 answers (n=2 gives two)
    generated = re.search(r"3 jobs in [0-9.]+ s; engine: (\d+) tokens generated", out)
    assert generated and 4 <= int(generated[1]) <= 4 * 8  # 4 samples of at most 8 tokens
    assert "were held once, shared by its 2 samples" in out
    assert "rq-dashboard --redis-url redis://" in out
    assert "[error" not in err and "Traceback" not in err, err[-4000:]
    assert not list(tmp_path.glob("pagedq-redis-*"))  # the embedded Redis cleaned up
