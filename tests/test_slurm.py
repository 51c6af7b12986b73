"""SLURM host lists and the torch.distributed environment derived from srun's variables."""

import pytest

from trillion.errors import ConfigError
from trillion.trainer.launch.slurm import expand_hostlist, torch_env_from_slurm


@pytest.mark.parametrize(
    "hostlist, expected",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        (
            "frontier[00012-00015,00020]",
            ["frontier00012", "frontier00013", "frontier00014", "frontier00015", "frontier00020"],
        ),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
        ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("x[1,3],y[08-09]", ["x1", "x3", "y08", "y09"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("bad", ["node[1-3", "node[a-b]"])
def test_malformed_hostlist_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="SLURM"):
        expand_hostlist(bad)


SRUN = {
    "SLURM_PROCID": "9",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "frontier[00012-00013]",
    "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
}


def test_torch_env_from_srun():
    env = torch_env_from_slurm(SRUN)
    assert env == {
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "frontier00012",
        "MASTER_PORT": str(29500 + 4242),
    }


def test_explicit_values_win_and_the_step_counts_its_own_tasks():
    env = torch_env_from_slurm({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "SLURM_STEP_NUM_TASKS": "8"})
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "1234" and env["WORLD_SIZE"] == "8"


def test_missing_variables_say_what_to_do():
    with pytest.raises(ConfigError, match="srun"):
        torch_env_from_slurm({"SLURM_JOB_ID": "1", "SLURM_NODELIST": "n1"})
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        torch_env_from_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_inconsistent_launch_variables_fail_before_the_rendezvous(monkeypatch):
    from trillion.trainer.launch.env import init_launch_env

    for name in ("SLURM_PROCID", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="RANK=5, WORLD_SIZE=4"):
        init_launch_env("cpu")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="LOCAL_RANK=1"):
        init_launch_env("cpu")


def test_one_node_without_a_tasks_per_node_count_takes_the_task_count():
    one_node = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    assert torch_env_from_slurm({**one_node, "SLURM_NNODES": "1"})["LOCAL_WORLD_SIZE"] == "16"
    assert (
        torch_env_from_slurm({**one_node, "SLURM_NNODES": "2"})["LOCAL_WORLD_SIZE"] == "1"
    )  # unknown: the check stays
