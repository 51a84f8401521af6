"""Recipes and the launch path: the paper's values, `--dry_run`, and tiny recipes through `accelerate launch`."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import write_longrm_jsonl

from trl_longrm.cli import run_train_in_this_process
from trl_longrm.testing_utils import save_tiny_model
from trl_longrm.train import parse_args, training_plan


ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
PAPER = ["sft.yaml", "simpo_grm.yaml", "simpo_disrm.yaml"]
LOW_MEMORY = [f"{stage}_{kind}.yaml" for stage in ("sft", "simpo_grm", "simpo_disrm") for kind in ("lora", "qlora")]
LONG_ROWS = ["sft_1m.yaml", "simpo_grm_1m.yaml", "simpo_disrm_1m.yaml"]


@pytest.mark.parametrize("name", PAPER + LOW_MEMORY + LONG_ROWS)
def test_recipe_dry_run_matches_the_paper(name, capsys):
    from trl_longrm.train import main

    # The memory plan (tests/test_memory_plan.py) traces an 8B step: not what this test checks.
    assert main([str(RECIPES / name), "--dry_run", "--memory_plan", "false"]) == 0
    out = capsys.readouterr().out
    script, args, model = parse_args([str(RECIPES / name), "--dry_run"])
    assert out.startswith(f"{script.stage} of {model.model_name_or_path} on ")  # the summary of the plan
    plan = training_plan(script, args, model)
    # The LongRM paper's appendix: shared by every stage.
    assert args.learning_rate == (2e-6 if name in PAPER + LONG_ROWS else 1e-5)
    assert args.warmup_steps == 0.03 and (args.adam_beta1, args.adam_beta2) == (0.9, 0.95)
    assert args.num_train_epochs == 1 and args.max_grad_norm == 1.0 and args.bf16
    assert args.per_device_train_batch_size == 1 and plan["global_batch_size"] == 32
    assert args.gradient_checkpointing
    # Preference stages place a group's prompt once (the shared-prefix default); SFT has no groups.
    assert plan["shared_prefix"] == (not name.startswith("sft"))
    if name in PAPER:
        assert args.max_length == 131072 and args.sequence_parallel_size == 8 and args.ring_head_stride == 4
        assert script.accelerate_config == "zero2.yaml" and plan["world_size"] == 8
        assert plan["data_parallel_size"] == 1 and plan["ring_groups"] == [list(range(8))]
        assert (plan["sequence_parallel_mode"], plan["ulysses_size"]) == ("ring", 1)
        # The mode is a recipe/command-line field like any other: Ulysses of 8 over the same group.
        _, ulysses, _ = parse_args([str(RECIPES / name), "--dry_run", "--sequence_parallel_mode", "ulysses"])
        assert training_plan(script, ulysses, model)["ulysses_size"] == 8
    if name in LONG_ROWS:
        # The paper recipe's layout at 1M tokens: ZeRO-3, checkpoint offload, tiled MLP, keys/values one head at a time.
        assert args.max_length == 1048576 and args.sequence_parallel_size == 8 and args.ring_head_stride == 1
        assert script.accelerate_config == "zero3.yaml" and plan["world_size"] == 8
        assert args.gradient_checkpointing_kwargs == {"use_reentrant": False, "offload": True}
        assert args.mlp_tile_tokens == 16384
    if "qlora" in name:
        assert model.load_in_4bit and model.bnb_4bit_quant_type == "nf4" and model.use_bnb_nested_quant
    if "lora" in name or "disrm" in name:
        assert model.use_peft and model.lora_target_modules in ("all-linear", ["all-linear"])
    stage = script.stage
    assert name.startswith(stage)
    if stage == "simpo_grm":
        assert (args.beta, args.simpo_gamma, args.nll_loss_weight) == (2.5, 0.5, 0.05)
        assert args.cpo_alpha == 0.05 and args.loss_type == "simpo"
        # LongRM's released code: cosine down to 0.1 x lr.
        assert args.lr_scheduler_type == "cosine_with_min_lr" and args.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    if stage != "sft":
        assert args.num_rejected == 2  # the paper's V = 2
    if name == "simpo_disrm.yaml":
        assert model.model_name_or_path == "Skywork/Skywork-Reward-V2-Llama-3.1-8B"
        assert (model.lora_r, model.lora_alpha) == (8, 8)
    if name == "sft.yaml":
        assert model.model_name_or_path == "Qwen/Qwen3-8B"


def test_cli_overrides_recipe_and_rejects_unknown_keys(tmp_path):
    script, args, _ = parse_args([str(RECIPES / "simpo_grm.yaml"), "--dry_run", "--beta", "1.5"])
    assert args.beta == 1.5 and args.simpo_gamma == 0.5
    bad = tmp_path / "bad.yaml"
    bad.write_text((RECIPES / "tiny" / "sft.yaml").read_text() + "not_an_option: 3\n")
    with pytest.raises(ValueError, match="not_an_option"):
        parse_args([str(bad), "--dry_run"])
    no_stage = tmp_path / "no_stage.yaml"
    no_stage.write_text("learning_rate: 1.0e-5\n")
    with pytest.raises(SystemExit):
        parse_args([str(no_stage)])


def test_stage_help_lists_every_option(capsys):
    # `python -m trl_longrm RECIPE --help` (the entry point accelerate launches), in this process.
    from trl_longrm.cli import main

    with pytest.raises(SystemExit) as stopped:
        main([str(RECIPES / "simpo_grm.yaml"), "--help"])
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    for option in ("--nll_loss_weight", "--sequence_parallel_size", "--ring_head_stride", "--lora_r", "--dry_run"):
        assert option in out
    assert "Weight of the token-mean NLL" in out
    # Resuming is documented where a user looks, not as TrainingArguments' "Not directly used by Trainer".
    resume_help = " ".join(out.split("--resume_from_checkpoint RESUME_FROM_CHECKPOINT,")[1].split("\n  --")[0].split())
    assert "newest complete one in `output_dir`" in resume_help and "Not directly used" not in resume_help
    assert "--overwrite_output_dir" in out


# ---------------------------------------------------------------- tiny recipes through accelerate (slow)


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    return {
        "lm": save_tiny_model(root / "lm", arch="qwen3", task="causal-lm", seed=1),
        "cls": save_tiny_model(root / "cls", arch="llama", task="seq-cls", seed=1),
        "pref": write_longrm_jsonl(root / "pref.jsonl", 8, num_rejected=2),
        "sft": write_longrm_jsonl(root / "sft.jsonl", 8, sft=True),
    }


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def launch(accelerate_config, recipe, *overrides, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / accelerate_config),
        "--main_process_port",
        free_port(),
        "-m",
        "trl_longrm",
        str(RECIPES / "tiny" / recipe),
        *overrides,
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def weights(directory):
    files = sorted(Path(directory).glob("*.safetensors"))
    assert files, f"no weights saved in {directory}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "accelerate_config,recipe,extra",
    [
        ("cpu_ddp.yaml", "simpo_grm.yaml", ["--sequence_parallel_size", "1"]),  # 2 processes, DDP
        ("cpu_zero2.yaml", "simpo_grm.yaml", ["--sequence_parallel_size", "1"]),  # DeepSpeed ZeRO-2
        # (the DisRM recipe's ring of 2 processes, rows truncated: the Ctrl-C test on two processes below)
    ],
)
def test_tiny_recipes_multi_process(tiny_assets, tmp_path, accelerate_config, recipe, extra):
    out = tmp_path / "run"
    launch(
        accelerate_config,
        recipe,
        "--model_name_or_path",
        tiny_assets["lm"],
        "--dataset_name",
        tiny_assets["pref"],
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        *extra,
    )
    trained = weights(out)
    assert all(torch.isfinite(t.float()).all() for t in trained.values())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["simpo_grm.yaml", "simpo_disrm.yaml"])
def test_tiny_qlora_recipes(tiny_assets, tmp_path, recipe):
    model = tiny_assets["cls"] if "disrm" in recipe else tiny_assets["lm"]
    out = tmp_path / "qlora"
    # One process (cpu_single.yaml), run in this one as `accelerate launch` runs it: the launch is other tests' subject.
    code = run_train_in_this_process(str(RECIPES / "tiny" / recipe), [
        "--accelerate_config", "cpu_single.yaml", "--num_processes", "1", "--model_name_or_path", model,
        "--dataset_name", tiny_assets["pref"], "--output_dir", str(out), "--max_steps", "2",
        "--sequence_parallel_size", "1", "--load_in_4bit", "true", "--use_peft", "true", "--lora_target_modules",
        "all-linear", "--bf16", "true", "--save_merged_model", "true",
    ])  # fmt: skip
    assert code == 0
    adapter = weights(out)
    assert any("lora_" in name for name in adapter)
    if "disrm" in recipe:
        assert any("score" in name for name in adapter), "the score head is saved with the adapter"
        saved = json.loads((out / "adapter_config.json").read_text())["modules_to_save"]
        assert "score" in saved and len(saved) == len(set(saved)), saved

    # The merged model is a plain bf16 checkpoint (no 4-bit state, no quantization config) ...
    merged = weights(out / "merged")
    assert not [n for n in merged if "absmax" in n or "quant" in n], sorted(merged)[:10]
    config = json.loads((out / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    base = weights(Path(model))
    for name, tensor in base.items():
        assert merged[name].shape == tensor.shape, name  # full-size weights, not packed 4-bit ones
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    # ... equal to what training used, the dequantised NF4 base plus the adapter: same outputs within bf16 rounding.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, BitsAndBytesConfig

    auto = AutoModelForSequenceClassification if "disrm" in recipe else AutoModelForCausalLM
    extra = {"num_labels": 1} if "disrm" in recipe else {}
    nf4 = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    trained = auto.from_pretrained(model, quantization_config=nf4, device_map="cpu", **extra)
    trained = PeftModel.from_pretrained(trained, str(out)).eval()
    plain = auto.from_pretrained(str(out / "merged"), **extra).eval()
    ids = torch.tensor([[5, 17, 42, 9, 23, 11, 7, 30]])
    with torch.no_grad():
        expected, got = trained(input_ids=ids).logits.float(), plain(input_ids=ids).logits.float()
    assert torch.allclose(got, expected, rtol=0.05, atol=0.05 * expected.abs().max().item()), (got - expected).abs().max()


RESUME_RUN = [
    "--max_steps",
    "6",
    "--per_device_train_batch_size",
    "2",
    "--save_strategy",
    "steps",
    "--save_steps",
    "2",
]


@pytest.fixture(scope="module")
def uninterrupted_run(tiny_assets, tmp_path_factory):
    """The reference of the resumed runs, trained in this process as `accelerate launch` would run its one process
    (the tests below launch theirs: a resumed launch equal to it also shows the two routes agree)."""
    out = tmp_path_factory.mktemp("full")
    data = ["--model_name_or_path", tiny_assets["lm"], "--dataset_name", tiny_assets["sft"]]
    assert run_train_in_this_process(str(RECIPES / "tiny" / "sft.yaml"), ["--output_dir", str(out), *data,
                                                                          *RESUME_RUN]) == 0  # fmt: skip
    return weights(out)


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_command(tiny_assets, uninterrupted_run, tmp_path, capfd, caplog):
    """SIGKILL mid-run (no clean-up at all), just after checkpoint-4 was written, whose weights are then damaged: the
    same command resumes from checkpoint-2 and ends where an uninterrupted run ends. (A stop after the last checkpoint,
    before the final model, is the Ctrl-C test's.)"""
    killed = tmp_path / "killed"
    args = [
        "--output_dir", str(killed), "--model_name_or_path", tiny_assets["lm"], "--dataset_name", tiny_assets["sft"],
        *RESUME_RUN,
    ]  # fmt: skip
    kill_after_save = (
        "import os, signal, sys, transformers\n"
        "save = transformers.Trainer._save_checkpoint\n"
        "def save_then_die(self, model, trial):\n"
        "    save(self, model, trial)\n"
        "    if self.state.global_step == 4:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "transformers.Trainer._save_checkpoint = save_then_die\n"
        "from trl_longrm.train import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", kill_after_save, str(RECIPES / "tiny" / "sft.yaml"), *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    newest = killed / "checkpoint-4"
    assert newest.is_dir() and not (killed / "trainer_state.json").exists()
    data = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes(data[: len(data) // 2])

    # The same command again (its one process in this one; the Ctrl-C tests resume through the launch): it resumes
    # from the newest complete checkpoint and says so.
    recipe = str(RECIPES / "tiny" / "sft.yaml")
    assert run_train_in_this_process(recipe, args) == 0
    out = capfd.readouterr().out
    assert f"Skipping damaged checkpoint {newest}: model.safetensors is unreadable" in caplog.text  # a warning
    assert f"Resuming from {killed / 'checkpoint-2'} at step 2." in out
    final = weights(killed)
    assert final.keys() == uninterrupted_run.keys()
    for name in final:
        torch.testing.assert_close(final[name], uninterrupted_run[name], atol=1e-5, rtol=0, msg=name)
    assert json.loads((killed / "trainer_state.json").read_text())["global_step"] == 6

    # Once more, without `--resume_from_checkpoint`: a finished run is not trained again.
    from trl_longrm.train import main

    mtime = (killed / "model.safetensors").stat().st_mtime_ns
    assert main([recipe, *args]) == 0
    assert f"{killed} already holds the final model of a finished run (step 6 of 6)" in capfd.readouterr().out
    assert (killed / "model.safetensors").stat().st_mtime_ns == mtime


def interruptible():
    """`preexec_fn` of a child that a test interrupts: SIGINT at its default, as in a terminal's foreground job. A
    shell starts background jobs (`cmd &` without job control, as a CI runner may run the suite) with SIGINT ignored,
    which their children inherit; Python then installs no KeyboardInterrupt handler, and the signal does nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def trl_longrm_train(recipe, *args, env=None, **popen):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    command = [str(Path(sys.executable).parent / "trl-longrm"), "train", str(RECIPES / "tiny" / recipe), *args]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


# Imported by every Python process of a launch (PYTHONPATH): the training process pauses after the checkpoint of step
# PAUSE_AFTER_CHECKPOINT, so that a signal sent then lands there whatever the machine's speed.
PAUSE_AFTER_CHECKPOINT = """
import os, time
if os.environ.get("PAUSE_AFTER_CHECKPOINT"):
    import transformers
    save = transformers.Trainer._save_checkpoint
    def save_then_pause(self, model, trial):
        save(self, model, trial)
        if self.state.global_step == int(os.environ["PAUSE_AFTER_CHECKPOINT"]):
            time.sleep(300)
    transformers.Trainer._save_checkpoint = save_then_pause
"""


def ctrl_c_after_checkpoint(step, recipe, args, out_dir, tmp_path):
    """Start `trl-longrm train` paused after its checkpoint of `step`, then send the SIGINT a terminal's Ctrl-C
    sends."""
    import time

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PAUSE_AFTER_CHECKPOINT)
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]), "PAUSE_AFTER_CHECKPOINT": str(step)}
    # Its own process group, as a terminal's foreground job: the SIGINT reaches it as a Ctrl-C does.
    process = trl_longrm_train(recipe, *args, env=env, start_new_session=True, preexec_fn=interruptible)
    deadline = time.monotonic() + 300
    while not (out_dir / f"checkpoint-{step}" / "trainer_state.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=300)
    return process, out, err


@pytest.mark.slow
def test_a_bad_row_on_two_processes_is_one_message(tiny_assets, tmp_path):
    data = tmp_path / "pref.jsonl"
    lines = Path(tiny_assets["pref"]).read_text().splitlines()
    bad = json.loads(lines[5])
    bad["rejects"] = []
    data.write_text("\n".join([*lines[:5], json.dumps(bad), *lines[6:]]) + "\n")
    process = trl_longrm_train(
        "simpo_disrm.yaml",  # cpu_ddp.yaml: 2 processes, one ring of 2
        *(
            "--model_name_or_path",
            tiny_assets["cls"],
            "--dataset_name",
            str(data),
            "--output_dir",
            str(tmp_path / "o"),
        ),
    )
    out, err = process.communicate(timeout=600)
    assert process.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors == [f"trl-longrm: error: {data}, line 6, key 'rejects': must hold at least one rejected response, "
                      "got an empty list"], err[-3000:]  # fmt: skip
    assert "Traceback" not in err and "ChildFailedError" not in err


@pytest.mark.slow
def test_ctrl_c_stops_without_a_traceback_and_the_same_command_resumes(tiny_assets, uninterrupted_run, tmp_path,
                                                                       capsys):  # fmt: skip
    """Ctrl-C after the last checkpoint (step 6 of 6), before the final model: one line, no traceback, and the same
    command resumes there without training a 7th step."""
    out_dir = tmp_path / "run"
    args = [
        "--output_dir",
        str(out_dir),
        "--model_name_or_path",
        tiny_assets["lm"],
        "--dataset_name",
        tiny_assets["sft"],
    ]
    args += RESUME_RUN
    process, out, err = ctrl_c_after_checkpoint(6, "sft.yaml", args, out_dir, tmp_path)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert f"Interrupted. The same command resumes from the newest complete checkpoint in {out_dir}." in out
    assert not (out_dir / "trainer_state.json").exists()

    # The same command resumes: `trl-longrm train`'s checks and the process accelerate would start with the recipe's
    # cpu_single.yaml, here in this process (`run_train_in_this_process`: the interrupted run above is the real
    # launch; the two-process test below resumes through the literal command).
    from trl_longrm.cli import run_train_in_this_process

    capsys.readouterr()
    assert run_train_in_this_process(str(RECIPES / "tiny" / "sft.yaml"), args) == 0
    out = capsys.readouterr().out
    assert f"Resuming from {out_dir / 'checkpoint-6'} at step 6." in out
    assert "accelerate" in out and "cpu_single.yaml" in out
    assert json.loads((out_dir / "trainer_state.json").read_text())["global_step"] == 6
    final = weights(out_dir)
    assert final.keys() == uninterrupted_run.keys()
    for name in final:
        torch.testing.assert_close(final[name], uninterrupted_run[name], atol=1e-5, rtol=0, msg=name)

    # Once more with `--resume_from_checkpoint last`: a finished run is not trained again. The training process's own
    # entry point in this process (what `accelerate launch -m trl_longrm` runs; its check needs no launcher).
    from trl_longrm.train import main

    mtime = (out_dir / "model.safetensors").stat().st_mtime_ns
    assert main([str(RECIPES / "tiny" / "sft.yaml"), *args, "--resume_from_checkpoint", "last"]) == 0
    assert f"{out_dir} already holds the final model of a finished run (step 6 of 6)" in capsys.readouterr().out
    assert (out_dir / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_ctrl_c_on_two_processes_is_one_line_and_the_same_command_resumes(tiny_assets, tmp_path):

    out_dir = tmp_path / "run"
    args = ["--output_dir", str(out_dir), "--model_name_or_path", tiny_assets["cls"], "--dataset_name"]
    args += [tiny_assets["pref"], "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2"]
    args += ["--max_length", "96"]  # rows truncated
    # cpu_ddp.yaml: 2 processes, one ring of 2.
    process, out, err = ctrl_c_after_checkpoint(2, "simpo_disrm.yaml", args, out_dir, tmp_path)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    assert out.count("Interrupted. The same command resumes") == 1, out[-3000:]

    resumed = trl_longrm_train("simpo_disrm.yaml", *args)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"Resuming from {out_dir / 'checkpoint-2'} at step 2." in out
    assert json.loads((out_dir / "trainer_state.json").read_text())["global_step"] == 4
    assert all(torch.isfinite(t.float()).all() for t in weights(out_dir).values())
    # Every rank prepares the data; the truncation report is printed once, by rank 0.
    reports = [line for line in err.splitlines() if "truncated (middle of the prompt" in line]
    assert len(reports) == 1 and f"{tiny_assets['pref']}: tokenised 8 rows" in reports[0], err[-3000:]


def test_dry_run_prints_tokens_per_row_shared_and_unshared(tiny_assets, tmp_path, capsys):
    """With local data and tokenizer, `--dry_run` of a preference recipe prints what the data's median group occupies
    in a row with its prompt once and with it once per response (counted here from the tokenised groups by hand)."""
    import json

    from trl_longrm.data import load_preference_dataset, tokenize_preference_dataset
    from trl_longrm.train import main

    argv = [
        str(RECIPES / "tiny" / "simpo_grm.yaml"),
        "--model_name_or_path",
        tiny_assets["lm"],
        "--dataset_name",
        tiny_assets["pref"],
        "--output_dir",
        str(tmp_path / "grm"),
        "--dry_run",
        "--dry_run_output",
        "json",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    plan = json.loads(out[: out.index("\n}\n") + 3])["plan"]
    typical = plan["typical_group"]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["lm"])
    groups, _ = tokenize_preference_dataset(load_preference_dataset(tiny_assets["pref"]), tokenizer, max_length=2048)
    sizes = []
    for g in groups:
        responses = [g["chosen_completion_ids"], *g["rejected_completion_ids"]]
        tokens = sum(len(r) for r in responses)
        sizes.append((len(g["prompt_ids"]) + tokens, len(g["prompt_ids"]) * len(responses) + tokens))
    shared, unshared = sorted(sizes)[len(sizes) // 2]
    assert typical["sampled_groups"] == len(groups) == 8 and typical["layout_used"] == "shared"
    assert (typical["tokens_per_row_shared"], typical["tokens_per_row_unshared"]) == (shared, unshared)
    assert 2 * shared < unshared  # 2 rejected + 1 chosen: the prompt is most of a group
