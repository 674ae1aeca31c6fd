"""CPU seconds and peak RSS of this process and every process it started, from /proc.

vLLM runs its engine in a child process: a figure of the calling process alone would leave
out the part that does the work. Standard library only, so that the peers' own venvs can
import it too.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()  # the fields after the command's name


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError):  # gone meanwhile
                continue
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def cpu_seconds(root: int | None = None) -> float:
    """User + system CPU seconds of the tree so far, its reaped children included."""
    total = 0
    for pid in _tree(root or os.getpid()):
        try:
            fields = _stat(pid)
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / _TICKS


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far, its children left out: a server's own
    share (redis-server's, the gateway's)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICKS


def peak_rss_mb(root: int | None = None) -> float:
    """The sum over the tree's live processes of each one's peak resident set (VmHWM)."""
    total_kb = 0
    for pid in _tree(root or os.getpid()):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total_kb += next((int(line.split()[1]) for line in status.splitlines()
                          if line.startswith("VmHWM:")), 0)
    return total_kb / 1024
