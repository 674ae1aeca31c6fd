"""``python -m worker.healthcheck [healthz|readyz]``: the worker image's HEALTHCHECK. Asks the
worker's metrics port (``PAGEDQ_METRICS_PORT``) on this host; exits 0 on 200, else 1 with the
reason. Imports neither torch nor the worker: it runs every 30 s beside the model."""

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    probe = (list(argv) if argv is not None else sys.argv[1:] or ["healthz"])[0]
    port = os.environ.get("PAGEDQ_METRICS_PORT", "")
    if not port.isdigit() or int(port) == 0:
        print("PAGEDQ_METRICS_PORT is not set: nothing to ask", file=sys.stderr)
        return 1
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/{probe}", timeout=5) as reply:
            print(reply.read().decode().strip())
            return 0
    except urllib.error.HTTPError as exc:
        print(f"{exc.code}: {exc.read().decode().strip()}", file=sys.stderr)
    except OSError as exc:
        print(f"no answer: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
