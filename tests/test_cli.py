import subprocess
import sys
from pathlib import Path


def test_console_script_help():
    exe = Path(sys.executable).parent / "trl-longrm"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    assert "train" in out and "eval" in out


def test_a_one_process_recipe_runs_as_accelerate_launch_would_start_it():
    """`run_train_in_this_process` takes the process's command and variables from accelerate's own launcher code: the
    tiny SFT recipe (cpu_single.yaml, 1 process) is one plain process on the CPU; the tiny DisRM recipe (cpu_ddp.yaml,
    2 processes) and a ZeRO-2 config are not, and are launched."""
    from trl_longrm.cli import launch_command, plain_process_launch

    recipes = Path(__file__).resolve().parents[1] / "recipes" / "tiny"
    command, env = plain_process_launch(launch_command(str(recipes / "sft.yaml"), ["--max_steps", "2"]))
    assert command[1:] == ["-m", "trl_longrm", str(recipes / "sft.yaml"), "--max_steps", "2"]
    assert env["ACCELERATE_USE_CPU"] == "True" and env["ACCELERATE_MIXED_PRECISION"] == "no"
    assert plain_process_launch(launch_command(str(recipes / "simpo_disrm.yaml"), [])) is None
    zero2 = ["--accelerate_config", "cpu_zero2.yaml", "--num_processes", "1"]
    assert plain_process_launch(launch_command(str(recipes / "sft.yaml"), zero2)) is None
