"""Headless Chromium for tests: Debian's ``chromium`` started as the issue prescribes (headless,
no sandbox, no GPU, no background networking, no first run, a fresh user-data dir each time),
and a local proxy that adds basic auth, which headless Chromium cannot answer itself."""

import base64
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


class AuthProxy:
    """Headless Chromium cannot answer a basic-auth challenge (credentials in the URL give
    ERR_INVALID_AUTH_CREDENTIALS), so the browser goes through this local proxy, which adds
    the Authorization header a user's browser would send after the login prompt."""

    def __init__(self, upstream: str, auth: tuple[str, str]) -> None:
        token = "Basic " + base64.b64encode(":".join(auth).encode()).decode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                request = urllib.request.Request(upstream + self.path,
                                                 headers={"Authorization": token})
                try:
                    reply = urllib.request.urlopen(request, timeout=30)
                except urllib.error.HTTPError as exc:
                    reply = exc
                body = reply.read()
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.headers.get("Content-Type", ""))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def chromium(*args: str, tmp: Path) -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    profile = tmp / f"chromium-profile-{time.monotonic_ns()}"  # fresh each time
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-background-networking", "--no-first-run", "--disable-component-update",
               "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
