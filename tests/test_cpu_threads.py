"""Threads per process: every process `trl-longrm` starts gets `cores // processes on this machine` threads and
passive OpenMP waits, unless the user chose otherwise (a second busy process must not oversubscribe the cores)."""

from pathlib import Path

import pytest

from trl_longrm import cli
from trl_longrm.cpu_threads import launch_env, threads_per_process, usable_cores


ROOT = Path(__file__).resolve().parents[1]


def test_threads_per_process_never_oversubscribes():
    for cores in (1, 2, 3, 16):
        for processes in (1, 2, 3, 8):
            threads = threads_per_process(processes, cores=cores)
            assert threads >= 1
            assert processes * threads <= max(cores, processes)  # one thread each when there are more processes
            assert processes * (threads + 1) > cores  # and no core left idle that a thread more would use
    assert 1 <= usable_cores()


def test_launch_env_sets_threads_and_passive_waits_but_keeps_the_users():
    env = launch_env(2, env={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": str(threads_per_process(2)), "OMP_WAIT_POLICY": "PASSIVE"}
    mine = launch_env(2, env={"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"})
    assert mine == {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"}


@pytest.mark.parametrize(
    "recipe, overrides, expected",
    [
        ("recipes/tiny/sft.yaml", [], 1),
        ("recipes/tiny/simpo_disrm.yaml", [], 2),  # the demo's ring of 2 CPU processes
        ("recipes/tiny/simpo_disrm.yaml", ["--num_processes", "1"], 1),
        # 16 processes over the 2 machines of the multi-node config: 8 on this one.
        ("recipes/simpo_grm.yaml", ["--accelerate_config", "multi_node_ddp.yaml", "--num_processes", "16"], 8),
    ],
)
def test_training_launch_counts_the_processes_of_this_machine(recipe, overrides, expected):
    assert cli.local_processes(str(ROOT / recipe), overrides) == expected


def test_training_launch_passes_the_thread_env(monkeypatch, tmp_path, capsys):
    # Everything up to the launch is real (the recipe, preflight); the launch itself is captured.
    seen = {}
    monkeypatch.setattr(cli, "run_launch", lambda command, env=None: seen.update(command=command, env=env) or 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr("trl_longrm.train.preflight", lambda argv: None)
    assert cli.main(["train", str(ROOT / "recipes/tiny/simpo_disrm.yaml"), "--output_dir", str(tmp_path)]) == 0
    assert seen["env"]["OMP_NUM_THREADS"] == str(threads_per_process(2))
    assert seen["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert f"OMP_NUM_THREADS={threads_per_process(2)}" in capsys.readouterr().out


def test_a_users_oversubscribing_thread_count_is_kept_and_warned_about(monkeypatch, tmp_path, capsys):
    from trl_longrm.cpu_threads import oversubscription

    cores = usable_cores()
    assert oversubscription({"OMP_NUM_THREADS": str(cores)}, 1) is None
    assert oversubscription({}, 4) is None  # ours is never too many
    message = oversubscription({"OMP_NUM_THREADS": str(cores)}, 2)
    assert f"OMP_NUM_THREADS={cores} with 2 processes" in message and "oversubscribe" in message

    seen = {}
    monkeypatch.setattr(cli, "run_launch", lambda command, env=None: seen.update(env=env) or 0)
    monkeypatch.setattr("trl_longrm.train.preflight", lambda argv: None)
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores))
    assert cli.main(["train", str(ROOT / "recipes/tiny/simpo_disrm.yaml"), "--output_dir", str(tmp_path)]) == 0
    assert seen["env"]["OMP_NUM_THREADS"] == str(cores)  # the user's choice stands
    assert "oversubscribe" in capsys.readouterr().err
