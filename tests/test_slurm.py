"""SLURM's environment read at the command line's edge (autoshard/slurm.py): the node list's
forms, the rendezvous endpoint on the first node, and the one-line refusals."""

from __future__ import annotations

import pytest

from autoshard.errors import ConfigError
from autoshard.slurm import BASE_PORT, PORT_SPAN, parse_nodelist, slurm_settings


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("login", ["login"]),
        ("a,b", ["a", "b"]),
        ("gpu[01-03,07],login", ["gpu01", "gpu02", "gpu03", "gpu07", "login"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("n[8-10]", ["n8", "n9", "n10"]),  # the width is the lower bound's: no padding here
        ("", []),
    ],
)
def test_a_node_list_is_read_in_its_common_forms(nodelist: str, hosts: list[str]) -> None:
    assert parse_nodelist(nodelist) == hosts


def step(**extra: str) -> dict[str, str]:
    return {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]"} | extra


def test_the_endpoint_is_the_first_node_on_a_port_of_the_job() -> None:
    settings = slurm_settings(step(SLURM_JOB_ID="4242"))
    assert settings == {
        "nodes": 2, "node_rank": 0, "rdzv_endpoint": f"gpu07:{BASE_PORT + 4242 % PORT_SPAN}",
        "job_id": "4242",
    }  # fmt: skip
    # the step's own node list before the job's, and MASTER_PORT when the job sets one
    steps = slurm_settings(step(SLURM_STEP_NODELIST="b[1-2]", MASTER_PORT="1234"))
    assert steps is not None and steps["rdzv_endpoint"] == "b1:1234"


def test_outside_a_job_step_there_are_no_settings() -> None:
    assert slurm_settings({}) is None
    assert slurm_settings({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2"}) is None  # salloc, no srun


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"SLURM_NNODES": "two"}, "not numbers"),
        ({"SLURM_NTASKS": "16"}, "--ntasks-per-node=1"),
        ({"SLURM_JOB_NODELIST": ""}, "--rdzv-endpoint"),
    ],
)
def test_what_cannot_work_is_one_line_saying_what_to_do(extra: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        slurm_settings(step(**extra))
    assert says in str(caught.value) and "\n" not in str(caught.value)
