"""Counting a job's processes in tests: every process started with ``MARK=marker`` in its environment
(torchrun, its ranks in their own sessions, and whatever they start inherit it), read from /proc
(Linux), so a test can say that nothing of a job outlived it, and clean up what did."""
from __future__ import annotations

import os
import signal
import time

MARK = "DMUON_TEST_MARK"


def marked_processes(marker: str) -> dict:
    """pid -> command line of every process whose environment holds ``DMUON_TEST_MARK=marker``."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"{MARK}={marker}".encode() in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        out[int(pid)] = c.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            pass
    return out


def left_behind(marker: str, wait_s: float = 5.0) -> dict:
    """The marked processes still there after up to ``wait_s`` (a process ends a moment after its parent)."""
    deadline = time.monotonic() + wait_s
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_marked(marker: str) -> None:
    for pid in marked_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
