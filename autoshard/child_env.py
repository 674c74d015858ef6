"""The environment of every Python child process autoshard, its benchmarks and its tests start.

A child gets this process's environment with its own folders put in front of ``PYTHONPATH``,
never in place of it: where the dependencies come from ``PYTHONPATH`` alone (a machine without
network, whose wheels are installed with ``pip install --target`` and put on ``PYTHONPATH``, as
``benchmarks/gpu.sh`` does), a child given a ``PYTHONPATH`` of its own fails at its first
import. tests/test_child_env.py checks that nothing else in the project sets ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def extended_pythonpath(front: tuple[str | os.PathLike[str], ...], inherited: str | None) -> str:
    """``front``'s folders, then the inherited ``PYTHONPATH``'s, each once, in that order (an
    empty entry, which Python reads as the current folder, is dropped)."""
    entries = [os.fspath(p) for p in front] + (inherited or "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def child_env(
    *front: str | os.PathLike[str],
    base: Mapping[str, str] | None = None,
    **variables: str,
) -> dict[str, str]:
    """This process's environment (or ``base``) with ``variables`` set and ``front`` put before
    its ``PYTHONPATH``. ``PYTHONPATH`` itself is not a variable to pass: folders go in
    ``front``, so the inherited ones are kept."""
    if "PYTHONPATH" in variables:
        raise TypeError("child_env: pass folders as positional arguments, not PYTHONPATH=")
    env = dict(os.environ if base is None else base)
    env.update(variables)
    env["PYTHONPATH"] = extended_pythonpath(front, env.get("PYTHONPATH"))
    return env
