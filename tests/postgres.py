"""A PostgreSQL server of its own, in a temporary folder, listening on 127.0.0.1 only: for the
tests and the benchmark of studies shared by several drivers (the binaries come with the
PostgreSQL server package: /usr/lib/postgresql/*/bin on Debian and Ubuntu)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a server; yield its URL (database ``study``, user ``autoshard``, no password)."""
    bin_dir = binaries()
    if bin_dir is None:
        raise FileNotFoundError("no PostgreSQL binaries (initdb, pg_ctl) on this machine")
    root = Path(tempfile.mkdtemp(prefix="autoshard-pg-"))
    # initdb refuses to run as root: run the server as an unprivileged user.
    run_as: list[str] = []
    if os.geteuid() == 0:
        os.chown(root, 65534, 65534)  # nobody
        run_as = ["runuser", "-u", "nobody", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = root / "data"

    def pg(*cmd: str) -> None:
        subprocess.run([*run_as, *cmd], check=True, capture_output=True, timeout=120)

    try:
        pg(str(bin_dir / "initdb"), "-D", str(data), "-U", "autoshard", "--auth=trust")
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
        pg(str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"),
           "-w", "start")  # fmt: skip
        try:
            pg(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "autoshard",
               "study")  # fmt: skip
            yield f"postgresql://autoshard@127.0.0.1:{port}/study"
        finally:
            subprocess.run(
                [*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                capture_output=True,
                timeout=60,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
