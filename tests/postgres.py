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


class PostgresServer:
    """A running server of :func:`postgres_instance`: its URL, and stop/start to play a restart
    (the same port and data)."""

    def __init__(self, bin_dir: Path, data: Path, root: Path, port: int, run_as: list[str]):
        self.bin_dir, self.data, self.root, self.port, self.run_as = (
            bin_dir, data, root, port, run_as,
        )  # fmt: skip
        self.url = f"postgresql://autoshard@127.0.0.1:{port}/study"

    def pg(self, *cmd: str) -> None:
        subprocess.run([*self.run_as, *cmd], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        self.pg(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-o", options, "-l",
                str(self.root / "log"), "-w", "start")  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """Stop it: ``fast`` ends every session, as a restart or a failover does."""
        subprocess.run(
            [*self.run_as, str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w",
             "stop"], capture_output=True, timeout=60,
        )  # fmt: skip


@contextlib.contextmanager
def postgres_instance() -> Iterator[PostgresServer]:
    """Start a server (database ``study``, user ``autoshard``, no password); yield it."""
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
    server = PostgresServer(bin_dir, root / "data", root, port, run_as)
    try:
        server.pg(str(bin_dir / "initdb"), "-D", str(server.data), "-U", "autoshard",
                  "--auth=trust")  # fmt: skip
        server.start()
        try:
            server.pg(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U",
                      "autoshard", "study")  # fmt: skip
            yield server
        finally:
            server.stop("immediate")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a server; yield its URL (database ``study``, user ``autoshard``, no password)."""
    with postgres_instance() as server:
        yield server.url
