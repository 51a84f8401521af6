"""`trl-longrm` command line: `train` runs a training stage from a recipe, `eval` runs Long-RewardBench, `score` scores
a file, `data` makes the method's data from a corpus, `reward-server` serves a judge's rewards, `plan` finds the
settings that fit your GPUs."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading

from trl_longrm.cpu_threads import launch_env, oversubscription
from trl_longrm.evaluation.cli import add_eval_arguments, add_score_arguments, run_eval, run_score
from trl_longrm.launch import find_accelerate_config, launch_settings, local_processes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-longrm",
        description="Train and evaluate long-context reward models (LongRM) with TRL.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    # No `-h` of its own: `train RECIPE --help` is answered by the stage's parser, which knows every option.
    train_parser = subparsers.add_parser(
        "train",
        add_help=False,
        help="Run a training stage (sft, simpo_grm, simpo_disrm) from a YAML recipe, under `accelerate launch`.",
        description="Launch `accelerate launch -m trl_longrm RECIPE [OPTIONS]` with the accelerate config and process "
        "count the recipe names (`accelerate_config`, `num_processes`). Options after the recipe override its values "
        "(`--learning_rate 1e-6`); `--dry_run` prints the plan without launching or loading weights. "
        "`trl-longrm train RECIPE --help` lists every option of the recipe's stage.",
    )
    train_parser.add_argument("recipe", nargs="?", help="YAML recipe; its `stage` key picks the trainer.")
    train_parser.set_defaults(handler=run_train, print_help=train_parser.print_help)
    eval_parser = subparsers.add_parser(
        "eval",
        help="Evaluate a reward model on Long-RewardBench.",
        description="Evaluate a generative or discriminative reward model on Long-RewardBench (resumable).",
    )
    add_eval_arguments(eval_parser)
    eval_parser.set_defaults(handler=run_eval)
    score_parser = subparsers.add_parser(
        "score",
        help="Score the completions of each row of a JSONL file with a reward model.",
        description="Score each row's `completions` (texts or message lists) to its `prompt` (text or messages) with "
        "a DisRM or a generative judge (pointwise); writes the rows with `scores` in input order (resumable).",
    )
    add_score_arguments(score_parser)
    score_parser.set_defaults(handler=run_score)
    server_parser = subparsers.add_parser(
        "reward-server",
        help="Serve a generative judge's rewards to OpenRLHF or verl, each prompt's samples judged as one group.",
        description="A group-aware HTTP reward server: holds each sample until its group (same verl uid, or same "
        "OpenRLHF prompt) has --group-size samples, judges the group once with the judge served at --base-url, and "
        "answers each sample with its reward. OpenRLHF: --reward.remote_url http://HOST:PORT/get_reward; verl: "
        "trl_longrm.rewards.verl.JudgeRewardManager with TRL_LONGRM_REWARD_SERVER=http://HOST:PORT.",
    )
    from trl_longrm.rewards.server.main import add_reward_server_arguments, run_reward_server

    add_reward_server_arguments(server_parser)
    server_parser.set_defaults(handler=run_reward_server)
    plan_parser = subparsers.add_parser(
        "plan",
        help="The settings that fit a model, a stage and a data shape on your GPUs, ranked by estimated speed.",
        description="Search sequence parallelism, ZeRO, offloads, the tiled MLP and gradient checkpointing (full, "
        "selective, partial) for a model, a stage and a group shape on the given cards: each candidate's memory "
        "traced (the memory plan), its step time estimated, the fitting ones ranked by tokens per second; why each "
        "other layout failed. --write saves the fastest as a recipe (docs/memory_plan.md#what-fits-my-gpus).",
    )
    from trl_longrm.memory_plan.command import add_plan_arguments, run_plan

    add_plan_arguments(plan_parser)
    plan_parser.set_defaults(handler=run_plan)
    # No `-h` of its own: `data STEP --help` is answered by the step's parser (`trl_longrm.datagen.cli`).
    data_parser = subparsers.add_parser(
        "data",
        add_help=False,
        help="Make the method's data from your corpus: expand, respond, judge, vote, mix, distill, or a YAML pipeline.",
    )
    data_parser.set_defaults(handler=run_data)
    return parser


def run_data(args: argparse.Namespace, rest: list[str]) -> int:
    from trl_longrm.datagen.cli import main as data_main

    return data_main(rest)


def launch_command(recipe: str, overrides: list[str]) -> list[str]:
    """The `accelerate launch` command line that runs `recipe` with the recipe's accelerate settings."""
    accelerate_config, num_processes = launch_settings(recipe, overrides)
    # `--quiet`: a run that failed has printed why; accelerate's own traceback of the launch would only bury it.
    command = [sys.executable, "-m", "accelerate.commands.launch", "--quiet"]
    if accelerate_config:
        command += ["--config_file", find_accelerate_config(str(accelerate_config))]
    if num_processes:
        command += ["--num_processes", str(num_processes)]
    return [*command, "-m", "trl_longrm", recipe, *overrides]


def run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.recipe is None:
        args.print_help()
        return 0 if any(flag in overrides for flag in ("-h", "--help")) else 2
    if any(flag in overrides for flag in ("--dry_run", "--dry-run", "-h", "--help")):
        # Nothing to launch: resolve and print in this process.
        from trl_longrm.train import main as train_main

        return train_main([args.recipe, *overrides])
    from trl_longrm.train import preflight

    # Paths, splits and a finished run are checked here, once, before any process (or model) starts.
    code = preflight([args.recipe, *overrides])
    if code is not None:
        return code
    return launch(args.recipe, overrides)


def launch(recipe: str, overrides: list[str]) -> int:
    """Launch a checked recipe: `accelerate launch` with the recipe's settings, threads divided among its processes."""
    command = launch_command(recipe, overrides)
    # Processes x threads must not exceed the cores this process may use (`trl_longrm.cpu_threads`).
    local = local_processes(recipe, overrides)
    env = launch_env(local)
    warning = oversubscription(env, local)
    if warning:
        print(f"trl-longrm: warning: {warning}", file=sys.stderr, flush=True)
    print(f"Launching (OMP_NUM_THREADS={env['OMP_NUM_THREADS']}):", " ".join(command), flush=True)
    return run_launch(command, env)


def plain_process_launch(command: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """What the `accelerate launch` command line `command` (from `launch_command`) starts when that is one plain
    process (accelerate's simple launcher: no torchrun, DeepSpeed, FSDP or MPI): its command line and its variables,
    from accelerate's own code. None where it starts anything else."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(command[3:]))
    # The launchers `accelerate launch` picks before its simple one (`accelerate.commands.launch.launch_command`).
    other = any(getattr(args, name, False) for name in ("use_deepspeed", "use_fsdp", "use_megatron_lm", "multi_gpu", "tpu"))
    sagemaker = defaults is not None and str(getattr(defaults, "compute_environment", "")).endswith("SAGEMAKER")
    several = (args.num_processes or 1) != 1 or args.num_machines != 1 or args.mpirun_hostfile is not None
    if (other and not args.cpu) or sagemaker or several:
        return None
    return prepare_simple_launcher_cmd_env(args)


def run_train_in_this_process(recipe: str, overrides: list[str]) -> int:
    """`trl-longrm train RECIPE OVERRIDES` without starting a process where the recipe's launch is one plain process:
    the same checks, then the training process's entry point here, under the variables `accelerate launch` gives that
    process (and its thread count). It saves the two interpreters of a launch (~10 s on a small CPU machine: imports
    and teardown), which is most of a short run. Any other launch is started as `trl-longrm train` starts it.

    Example:
    ```python
    >>> from trl_longrm.cli import run_train_in_this_process
    >>> code = run_train_in_this_process("recipes/tiny/sft.yaml", ["--output_dir", "/tmp/sft", "--max_steps", "2"])
    ```
    """
    from unittest import mock

    import torch

    from trl_longrm.train import main as train_main
    from trl_longrm.train import preflight

    code = preflight([recipe, *overrides])
    if code is not None:
        return code
    command = launch_command(recipe, overrides)
    launched = plain_process_launch(command)
    if launched is None:
        return launch(recipe, overrides)
    process_command, process_env = launched
    argv = process_command[process_command.index("trl_longrm") + 1 :]  # `python -m trl_longrm RECIPE ...`
    env = launch_env(1, process_env)
    print(f"Running in this process (OMP_NUM_THREADS={env['OMP_NUM_THREADS']}), as", " ".join(command), flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        with mock.patch.dict(os.environ, env, clear=True):
            return train_main(argv)
    finally:
        torch.set_num_threads(threads)


# What `trl_longrm.train.main` prints (rank 0 only) for a user's mistake.
ERROR_MARK = b"trl-longrm: error:"


def run_launch(command: list[str], env: dict[str, str] | None = None) -> int:
    """Run `accelerate launch`, passing its stderr through until a process has reported a user error or the user
    pressed Ctrl-C: what comes after is the launchers' account of the same stop (accelerate's and torchrun's
    tracebacks, one per process), which would bury the one line that says what happened.

    The launch runs in its own process group and this process forwards SIGINT, SIGTERM and SIGHUP to it, so that it
    mutes the launchers' stderr *before* they see the signal; a second Ctrl-C kills the group."""
    env = dict(os.environ if env is None else env)
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, start_new_session=True)
    muted = threading.Event()
    interrupts = []

    def forward_output():
        for chunk in iter(lambda: os.read(process.stderr.fileno(), 1 << 16), b""):
            if muted.is_set():
                continue
            if ERROR_MARK in chunk:
                muted.set()  # this chunk carries the message itself: pass it on, not what follows
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()

    def forward_signal(signum, frame):
        muted.set()
        interrupts.append(signum)
        try:
            os.killpg(process.pid, signal.SIGKILL if len(interrupts) > 1 else signum)
        except ProcessLookupError:  # already gone
            pass

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, forward_signal) for signum in handled}
    thread = threading.Thread(target=forward_output, daemon=True)
    thread.start()
    try:
        code = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    thread.join(timeout=10)
    return 128 + interrupts[0] if interrupts else code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # bitsandbytes warns at import on CPUs with AVX512-BF16 that an optional kernels package for 4-bit inference on
    # CPU is missing; nothing of ours uses it.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # `python -m trl_longrm recipe.yaml ...` (what `accelerate launch -m trl_longrm` runs) trains one stage.
    if argv and argv[0].endswith((".yaml", ".yml")):
        from trl_longrm.train import main as train_main

        return train_main(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "train":
        # Everything after the recipe belongs to the stage's own parser (TrlParser).
        return args.handler(args, unknown)
    if args.command == "data":
        # Everything after `data` belongs to the step's or the pipeline's own parser.
        return args.handler(args, argv[argv.index("data") + 1 :])
    # Other subcommands take no unknown flags: re-parse strictly so that typos are errors.
    return args.handler(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
