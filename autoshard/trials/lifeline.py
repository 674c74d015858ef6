"""Process lifetimes: a worker group never outlives the process that launched it.

Three layers, because each has a gap the next one closes:

- ``PR_SET_PDEATHSIG`` (Linux): the kernel kills torchrun when the driver dies, and each worker
  when torchrun dies, even a worker stuck in native code that holds the GIL. It fires when the
  *thread* that started the child ends, so the driver asks for it only from its main thread.
- a watchdog thread in every worker (:func:`start_watchdog`): ends the process when the driver
  or torchrun is gone, whatever the main thread is doing (waiting for a request, in a trial, in
  a collective). Needed where there is no PDEATHSIG, and where the launcher was started from
  another thread.
- the driver kills the whole tree itself (:func:`kill_tree`) on a timeout, a crash, Ctrl-C, or
  any exception: torchrun starts each worker in a session of its own, so killing torchrun's
  process group alone would leave a hung worker behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCHDOG_SECONDS = 0.5


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent ends (Linux; False
    elsewhere). SIGKILL: a process stuck in a collective, or holding the GIL in native code,
    cannot be ended by anything it would have to run itself."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def parent_death_preexec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child die with this process, or
    None where that is not available. Only for a child started from the main thread: the signal
    is sent when the *thread* that forked the child ends, and other threads may be short-lived.
    (prctl is looked up here, before the fork: the child only makes the call.)"""
    prctl = _prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return preexec


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_watchdog(
    driver_pid: int, parent_pid: int, *, every: float = WATCHDOG_SECONDS, grace: float = 2.0
) -> threading.Thread:
    """A daemon thread that ends this process (``os._exit(1)``) when the parent (torchrun) is
    gone, or ``grace`` seconds after the driver is (time for an idle group to stop cleanly). It
    needs nothing from the main thread, which may be stuck in a collective: torch's collectives
    release the GIL while they wait, so this thread runs."""

    def watch() -> None:
        driver_gone_at = None
        while True:
            time.sleep(every)
            gone = None
            if os.getppid() != parent_pid:
                gone = f"its launcher (pid {parent_pid})"
            elif driver_pid and not alive(driver_pid):
                driver_gone_at = driver_gone_at or time.monotonic()
                if time.monotonic() - driver_gone_at >= grace:
                    gone = f"the driver (pid {driver_pid})"
            if gone:
                print(f"[autoshard worker {os.getpid()}] {gone} is gone: exiting", file=sys.stderr)
                with contextlib.suppress(Exception):
                    sys.stderr.flush()
                os._exit(1)

    thread = threading.Thread(target=watch, name="autoshard-watchdog", daemon=True)
    thread.start()
    return thread


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the field after the ")" that closes the command name: state, then the parent id
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group, and every process below it with their groups
    (found before their parent dies, which would hand them to init)."""
    below = descendants(pid)
    for p in [pid, *below]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p, signal.SIGKILL)
    for p in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
