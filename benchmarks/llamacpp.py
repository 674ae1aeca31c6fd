"""llama.cpp's ``llama-server`` as a peer (issue 16): started on a GGUF file that
``benchmarks/llamacpp_peer.sh`` built from the same checkpoint, driven through its native
``/completion`` endpoint with token-id prompts: streamed for the timings (``complete``), not
streamed for the token ids (``tokens``, with ``return_tokens``), so greedy tokens compare with
pagedq's one for one. The stream cannot give the ids: a chunk's ``tokens`` leave out the ids
whose text the server held back (a character's leading UTF-8 bytes), and SmolLM2 writes some
characters as two tokens (162 then 112 for "ע"): one 128-token reply streamed 66 ids.

Standard library only: the timings are the client's (when each chunk arrives), as for pagedq's
``Client``; the server's own ``timings`` are kept beside them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DIR = ROOT / ".llamacpp"
SERVER = DIR / "llama_cpp_python-0.3.16" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"


def missing(kind: str) -> str | None:
    """Why the peer cannot run here, or None."""
    if not SERVER.exists():
        return f"no {SERVER.relative_to(ROOT)} (bash benchmarks/llamacpp_peer.sh builds it)"
    if not gguf(kind).exists():
        return f"no {gguf(kind).relative_to(ROOT)} (bash benchmarks/llamacpp_peer.sh)"
    return None


def gguf(kind: str) -> Path:
    return DIR / f"smollm2-{kind}.gguf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``with LlamaServer("f32", threads=2, slots=1, ctx=4096) as server: ...``. ``kv`` is the
    KV type (``f32`` for the run whose arithmetic matches pagedq's fp32 cache, ``f16`` its
    default); ``flash``: flash attention (its fastest setting with F16 weights)."""

    def __init__(self, kind: str, *, threads: int, slots: int = 1, ctx: int = 4096,
                 kv: str = "f32", flash: bool = False, log: Path | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(SERVER), "-m", str(gguf(kind)), "-t", str(threads), "-tb", str(threads),
                    "-c", str(ctx * slots), "-np", str(slots), "--port", str(self.port),
                    "-ctk", kv, "-ctv", kv, *(["-fa"] if flash else [])]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        if self.log:  # benchmarks/out/ is not in a fresh clone
            Path(self.log).parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log or os.devnull, "w")  # noqa: SIM115 (the child's)
        env = os.environ | {"LD_LIBRARY_PATH": str(SERVER.parent)}  # a shared-library build
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}: {self.cmd}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)

    def _post(self, prompt: list[int], max_tokens: int, stream: bool) -> Any:
        """Greedy, ``ignore_eos``, no prompt cache."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False, "stream": stream,
                "return_tokens": True}
        req = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=600)

    def complete(self, prompt: list[int], max_tokens: int
                 ) -> tuple[float, list[float], dict[str, Any]]:
        """Streamed: (submit time, each token's arrival time, the server's timings). A chunk
        brings the tokens its ``tokens_predicted`` counts past the last chunk's, held-back
        ones included."""
        times: list[float] = []
        timings: dict[str, Any] = {}
        submitted = time.perf_counter()
        with self._post(prompt, max_tokens, stream=True) as response:
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                times += [now] * (event.get("tokens_predicted", 0) - len(times))
                timings = event.get("timings", timings)
        return submitted, times, timings

    def tokens(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Not streamed: every generated id."""
        with self._post(prompt, max_tokens, stream=False) as response:
            return list(json.loads(response.read())["tokens"])
