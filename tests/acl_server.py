"""A real redis-server with worker/redis.acl's users, for the ACL matrix and the gateway's
stack (a plain module, not a pytest plugin, so that both can import it)."""

from pathlib import Path

from worker.acl import render
from worker.redis_server import RedisServer

PASSWORDS = {"ADMIN": "admin-pw", "PRODUCER": "producer-pw", "WORKER": "worker-pw",
             "DASHBOARD": "dashboard-pw", "GATEWAY": "gateway-pw"}


def acl_server(directory: Path) -> tuple[RedisServer, dict[str, str]]:
    """A started server whose users are worker/redis.acl's (``server.url`` is the admin's), and
    each other user's URL by its lower-case name."""
    acl = directory / "users.acl"
    acl.write_text(render(PASSWORDS))
    server = RedisServer(data_dir=directory, password=PASSWORDS["ADMIN"],
                         extra_args=["--aclfile", str(acl)]).start()
    base = f"127.0.0.1:{server.port}/0"
    return server, {user.lower(): f"redis://{user.lower()}:{pw}@{base}"
                    for user, pw in PASSWORDS.items() if user != "ADMIN"}
