"""Where a single-node worker group meets: a store on 127.0.0.1 that the driver hosts.

torchrun's own stores (its c10d rendezvous store, and the store it shares with the workers)
listen on every interface whatever host they are given (``*:PORT``: torch's ``TCPStore``
binds the wildcard address). A study on one machine needs no other machine to reach it, so the
driver hosts the store itself, bound to 127.0.0.1 (``TCPStore(master_listen_fd=...)`` takes a
socket bound by the caller), and:

- torchrun joins it as a client only (:func:`torchrun_arguments`: ``is_host=false``), one
  rendezvous id per launch, and does not start the store it would share with the workers
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, :data:`TORCHRUN_ENV`);
- the workers form their process group on it (:func:`process_group_store`), not on a store of
  their own, which their rank 0 would open on every interface too;
- gloo's sockets, between the workers, are on the loopback interface
  (``GLOO_SOCKET_IFNAME``; gloo otherwise takes the address the host name resolves to).

Nothing of the study then listens beyond 127.0.0.1. Several nodes keep torchrun's static
rendezvous on the endpoint the user names (see :mod:`autoshard.trials.group`).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

# torchrun's environment for a single node: no store of its own shared with the workers
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
LOOPBACK = "127.0.0.1"


class LoopbackStore:
    """A ``TCPStore`` server on 127.0.0.1, in this process, for as long as the object lives.

    >>> store = LoopbackStore()
    >>> store.address.startswith("127.0.0.1:")
    True
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
        self.port = int(sock.getsockname()[1])
        # the store owns the socket from here (libuv closes it with the server)
        self.store = dist.TCPStore(
            LOOPBACK,
            self.port,
            is_master=True,
            master_listen_fd=sock.detach(),
            wait_for_workers=False,
            multi_tenant=True,
        )

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"


def torchrun_arguments(address: str, run_id: str) -> list[str]:
    """torchrun's rendezvous flags for one node whose store is ``address`` (a client of it)."""
    return [
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={address}",
        "--rdzv-conf=is_host=false",
        f"--rdzv-id={run_id}",
        f"--local-addr={LOOPBACK}",
    ]


def worker_environment() -> dict[str, str]:
    """What a single node's workers need besides torchrun's variables: gloo on loopback."""
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    return {"GLOO_SOCKET_IFNAME": loopback} if loopback else {}


def process_group_store(address: str, prefix: str, timeout: float) -> dict[str, Any]:
    """``init_process_group`` keywords for a worker of a single-node group: the driver's store
    at ``address`` (keys under ``prefix``, one per launch), and its rank and world from
    torchrun's environment."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    return {
        "store": dist.PrefixStore(prefix, client),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }
