"""``srun autoshard tune ...``: the worker group's nodes, this node's rank and the rendezvous
endpoint, read from the SLURM environment (read at the command line's edge, never deeper).

``srun`` starts one task per node (``--ntasks-per-node=1``); SLURM tells each its node count
(``SLURM_NNODES``), its node's index (``SLURM_NODEID``) and the job's nodes
(``SLURM_STEP_NODELIST`` or ``SLURM_JOB_NODELIST``, e.g. ``gpu[01-04,07]``). The first node is
node 0: it drives the study and hosts torchrun's static rendezvous, on ``MASTER_PORT`` when the
job sets one, else on a port derived from the job id (two jobs sharing a node do not collide).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from autoshard.errors import ConfigError

BASE_PORT = 29500
PORT_SPAN = 2000


def slurm_settings(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """``{"nodes", "node_rank", "rdzv_endpoint", "job_id"}`` inside a SLURM step, else None.

    >>> slurm_settings({})  # not under SLURM
    >>> env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    ...        "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    >>> slurm_settings(env)
    {'nodes': 2, 'node_rank': 1, 'rdzv_endpoint': 'gpu07:29742', 'job_id': '4242'}
    """
    if "SLURM_NODEID" not in environ or "SLURM_NNODES" not in environ:
        return None  # not inside a job step (an salloc shell without srun, or no SLURM)
    try:
        nodes = int(environ["SLURM_NNODES"])
        node_rank = int(environ["SLURM_NODEID"])
    except ValueError:
        raise ConfigError(
            f"SLURM_NNODES={environ['SLURM_NNODES']!r}, SLURM_NODEID={environ['SLURM_NODEID']!r}: "
            "not numbers; run autoshard through srun, or give --nodes and --node-rank"
        ) from None
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    if tasks and tasks.isdigit() and int(tasks) > nodes:
        raise ConfigError(
            f"srun started {tasks} tasks on {nodes} nodes: autoshard tune needs one per node "
            "(it launches the node's GPU workers itself); run srun --ntasks-per-node=1"
        )
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise ConfigError(
            "SLURM gave no node list (SLURM_JOB_NODELIST); give --rdzv-endpoint host:port of "
            "the first node"
        )
    job = environ.get("SLURM_JOB_ID", "")
    port = environ.get("MASTER_PORT") or str(
        BASE_PORT + (int(job) % PORT_SPAN if job.isdigit() else 0)
    )
    return {
        "nodes": nodes,
        "node_rank": node_rank,
        "rdzv_endpoint": f"{hosts[0]}:{port}",
        "job_id": job,
    }


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a SLURM node list: ``scontrol show hostnames`` when SLURM's tools are
    here, else autoshard's reading of the common forms (``a,b``, ``gpu[01-03,07]``,
    ``rack[1-2]-n[1-2]``).

    >>> parse_nodelist("gpu[01-03,07],login")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login']
    """
    if not nodelist:
        return []
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return parse_nodelist(nodelist)


def parse_nodelist(nodelist: str) -> list[str]:
    """The hosts of a node list, without SLURM (see :func:`expand_nodelist`)."""
    hosts: list[str] = []
    for item in _split_top(nodelist):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _expand_item(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    out = []
    for spec in match.group(1).split(","):
        lo, _, hi = spec.partition("-")
        if hi:
            width = len(lo)
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        else:
            numbers = [lo]
        for number in numbers:
            out.extend(_expand_item(head + number + tail))  # later brackets, e.g. rack[1-2]-n[1-2]
    return out
