"""A single node's rendezvous on loopback (trials/rendezvous.py): the driver's store listens on
127.0.0.1 only, torchrun is its client, and a worker's keys land under its launch's prefix."""

from __future__ import annotations

import pytest

from autoshard.trials.rendezvous import (
    LOOPBACK,
    LoopbackStore,
    process_group_store,
    torchrun_arguments,
    worker_environment,
)


def test_the_store_listens_on_loopback_and_a_worker_writes_under_its_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = LoopbackStore()
    host, _, port = server.address.rpartition(":")
    assert host == LOOPBACK == "127.0.0.1" and int(port) == server.port > 0
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    kwargs = process_group_store(server.address, "launch-7", timeout=10)
    assert (kwargs["rank"], kwargs["world_size"]) == (1, 2)
    kwargs["store"].set("ready", "yes")
    # under the launch's prefix (``check`` does not wait for a key that is not there)
    assert server.store.check(["launch-7/ready"]) and not server.store.check(["ready"])
    assert server.store.get("launch-7/ready") == b"yes"


def test_torchrun_is_a_client_of_the_drivers_store_on_loopback() -> None:
    args = torchrun_arguments("127.0.0.1:1234", "run-1")
    assert "--rdzv-endpoint=127.0.0.1:1234" in args and "--rdzv-id=run-1" in args
    assert "--rdzv-conf=is_host=false" in args  # torchrun must not start a store of its own
    assert f"--local-addr={LOOPBACK}" in args


def test_gloo_is_told_the_loopback_interface() -> None:
    env = worker_environment()
    assert env.get("GLOO_SOCKET_IFNAME", "lo").startswith("lo")
