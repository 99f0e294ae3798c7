"""Processes this one started, ended whole: :func:`run_or_kill` and :func:`kill_tree` (torchrun launches in
``scripts/distributed_check.py`` and the tests' launches, which must never outlive a timeout)."""

from __future__ import annotations

import os
import signal
import subprocess


def run_or_kill(command: list[str], env: dict[str, str], timeout: float,
                merge_stderr: bool = False) -> tuple[subprocess.CompletedProcess, bool]:
    """Run ``command`` to its end, its output captured (stderr into stdout with ``merge_stderr``); past ``timeout``
    seconds it is killed with every process it started (:func:`kill_tree`). The result, and whether it timed out."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        stdout, stderr = process.communicate()
        timed_out = True
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), timed_out


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
