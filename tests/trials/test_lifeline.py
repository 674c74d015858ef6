"""Process lifetimes (autoshard/trials/lifeline.py): a child started with the parent-death signal
dies with its parent; the watchdog ends a worker whose driver is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autoshard.child_env import child_env
from autoshard.trials.lifeline import alive, parent_death_preexec


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_the_parent_death_signal_dies_with_its_parent(tmp_path) -> None:
    # parent: starts a long sleep with the preexec hook, prints its pid, waits
    parent_code = (
        "import subprocess, sys, time\n"
        "from autoshard.trials.lifeline import parent_death_preexec\n"
        "child = subprocess.Popen(['sleep', '600'], preexec_fn=parent_death_preexec())\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = child_env(*sys.path)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, env=env)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert alive(child)
        parent.kill()  # kill -9: no cleanup runs in the parent
        parent.wait()
        deadline = time.monotonic() + 5
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert parent_death_preexec() is not None  # the main thread may ask for it...
    elsewhere: list[object] = []
    thread = threading.Thread(target=lambda: elsewhere.append(parent_death_preexec()))
    thread.start()
    thread.join()
    assert elsewhere == [None]  # ...another thread may not: its end would kill the child


def test_the_watchdog_ends_a_worker_whose_driver_is_gone() -> None:
    driver = subprocess.Popen(["sleep", "600"])
    code = (
        "import os, sys, time\n"
        "from autoshard.trials.lifeline import start_watchdog\n"
        f"start_watchdog({driver.pid}, os.getppid(), every=0.1)\n"
        "print('watching', flush=True)\n"
        "time.sleep(600)\n"  # the main thread is busy: the watchdog does not need it
    )
    env = child_env(*sys.path)
    worker = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == b"watching\n"
        time.sleep(0.5)
        assert worker.poll() is None
        driver.kill()
        driver.wait()
        assert worker.wait(timeout=5) == 1
        assert worker.stderr is not None and b"is gone: exiting" in worker.stderr.read()
    finally:
        worker.kill()
        driver.kill()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child of init may linger as one for a moment)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
