"""Processes this one started, ended whole: :func:`kill_tree` (torchrun launches in ``scripts/distributed_check.py``
and the tests' launches, which must never outlive a timeout)."""

from __future__ import annotations

import os
import signal


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (torchrun's agent and its workers): stopped first, so that it starts
    nothing more. The processes stay in the caller's process group, where whoever pauses that group (to time something
    alone on the machine) pauses them too; so they are found by their parents, in /proc (Linux)."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:  # it ended meanwhile; what it started may not have
        pass
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, stack = [pid], [pid]
    while stack:
        below = children.get(stack.pop(), [])
        tree += below
        stack += below
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
