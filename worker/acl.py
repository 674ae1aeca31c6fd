"""pagedq's Redis users (``worker/redis.acl``): ``producer`` (submit, stream, cancel, status,
stats), ``worker`` (every data command on ``pagedq:*`` and ``rq:*``, nothing of ``@admin`` or
``@dangerous``: no FLUSHALL, CONFIG, KEYS, ACL...), ``dashboard`` (reads ``rq:*``), ``gateway``
(the producer's rules, plus its own keys: files ``pagedq:file*`` and batches ``pagedq:batch*``,
and MULTI/EXEC for their transactions) and ``default`` (the operator's). The file holds
``@NAME_PASSWORD@`` placeholders: compose's redis service fills them in with ``sed`` from its
environment at start-up (the image has no Python); ``render`` does the same here, for tests and
for hosts without compose.

Why a producer's rules are narrow: its submit script (EVAL) needs its keys readable and
writable, so ``rq:job:*`` is in its key patterns, but no command that reads a hash is granted
there: it can create RQ records, never read them. ``SET`` is granted on cancel keys only,
``XADD`` alone on the cancel notices (``pagedq:cancels``: it cannot read who cancelled what),
``EXPIRE`` on its wake-up streams only, ``HGETALL`` / ``SMEMBERS`` on worker records only (a
selector each). It holds no XREADGROUP, XACK, XCLAIM or DEL: it cannot act as a worker. Result
streams are read-only to it (``%R~pagedq:results:*``): only workers write them. Its submit
script names a job's result key among its KEYS (to see whether the job exists), and EVAL
counts every key it names as written, so EVAL alone gets those keys writable, in a selector
of its own; the script's commands are checked one by one against the rules above, so a
script that writes a result stream is refused like a plain XADD. The
gateway's extra commands (DEL, SET, HGET...) sit in a selector on its own key patterns, so they
never reach ``rq:job:*`` or the job streams: it can do to those exactly what a producer can.
"""

import re
from pathlib import Path

TEMPLATE = Path(__file__).with_name("redis.acl")
PLACEHOLDER = re.compile(r"@([A-Z]+)_PASSWORD@")


def placeholders(template: str | None = None) -> set[str]:
    """The users whose passwords the template needs (``ADMIN``, ``PRODUCER``...)."""
    return set(PLACEHOLDER.findall(TEMPLATE.read_text() if template is None else template))


def render(passwords: dict[str, str], template: str | None = None) -> str:
    """The ACL file with ``passwords`` (by placeholder name: ``{"ADMIN": ...}``) filled in."""
    text = TEMPLATE.read_text() if template is None else template
    missing = placeholders(text) - passwords.keys()
    if missing:
        raise ValueError(f"no password for {sorted(missing)}")
    return PLACEHOLDER.sub(lambda m: passwords[m.group(1)], text)
