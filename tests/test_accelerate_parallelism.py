"""accelerate's `parallelism_config` with our trainers: `sp_size` (DeepSpeed's Ulysses) is honoured as our Ulysses
mode, set as an object in the config or in an accelerate YAML under DeepSpeed ZeRO-2; `cp_size` and requests that
disagree with our fields are refused at construction, naming the fields."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sp_trainer_worker as worker
import torch
from accelerate import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from test_sequence_parallel_trainers import PRELOAD, assert_state_close

from trl_longrm import LongSFTConfig, SimPODisRMConfig, SimPOGRMConfig
from trl_longrm.sequence_parallel.launch import find_free_port, run_on_gloo_ranks
from trl_longrm.testing_utils import build_chat_tokenizer


ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [SimPOGRMConfig, SimPODisRMConfig, LongSFTConfig]


def make(config_class, tmp_path, **fields):
    return config_class(output_dir=str(tmp_path), use_cpu=True, report_to=[], **fields)


@pytest.mark.parametrize("config_class", CONFIGS, ids=lambda c: c.__name__)
def test_sp_size_in_the_config_becomes_our_ulysses(tmp_path, config_class):
    args = make(config_class, tmp_path, parallelism_config=ParallelismConfig(sp_size=4, sp_backend="deepspeed"))
    assert (args.sequence_parallel_size, args.sequence_parallel_mode) == (4, "ulysses")
    assert not args.parallelism_config.sp_enabled  # accelerate does not run its own Ulysses as well
    plain = make(config_class, tmp_path)
    assert (plain.sequence_parallel_size, plain.sequence_parallel_mode, plain.parallelism_config) == (1, "ring", None)


def test_sp_size_survives_an_sft_config_given_to_the_sft_trainer(tmp_path):
    """LongSFTTrainer accepts TRL's SFTConfig and converts it: `to_dict` drops the ParallelismConfig object and hides
    the `*_token` fields (the eos_token set here came back as "<EOS_TOKEN>")."""
    from trl import SFTConfig

    from trl_longrm import LongSFTTrainer
    from trl_longrm.testing_utils import build_tiny_model

    tokenizer = build_chat_tokenizer()
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], eos_token=tokenizer.eos_token,
                     parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))  # fmt: skip
    data = worker.sft_examples(worker.random_groups(tokenizer, 2, 1))
    # One process cannot hold a group of 2: the error shows the request reached our config instead of being dropped.
    with pytest.raises(ValueError, match="sequence_parallel_size=2"):
        LongSFTTrainer(model=build_tiny_model("qwen3", "causal-lm", tokenizer), args=args, train_dataset=data,
                       processing_class=tokenizer)  # fmt: skip


def test_sp_size_from_the_accelerate_yaml_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    args = make(SimPODisRMConfig, tmp_path, sequence_parallel_size=2)  # agreeing with it is fine
    assert (args.sequence_parallel_size, args.sequence_parallel_mode) == (2, "ulysses")
    # An explicit config without sp_size: accelerate reads no variable any more.
    assert args.parallelism_config is not None and args.parallelism_config.sp_size == 1


def test_sp_handler_attention_maps_to_our_kernels(tmp_path):
    handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
    pc = ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=handler)
    assert make(SimPOGRMConfig, tmp_path, parallelism_config=pc).ring_attn_backend == "torch"


@pytest.mark.parametrize(
    "fields,fragments",
    [
        (dict(parallelism_config=ParallelismConfig(cp_size=2)), ["cp_size=2", "sequence_parallel_size=2"]),
        (dict(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"), sequence_parallel_size=4),
         ["sp_size=2", "sequence_parallel_size=4", "must agree"]),
        (dict(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"), sequence_parallel_mode="ring"),
         ["sp_size=2", "sequence_parallel_mode='ring'"]),
        (dict(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed", tp_size=2)),
         ["sp_size=2", "tp_size=2"]),
        (dict(parallelism_config=ParallelismConfig(
            sp_size=2, sp_backend="deepspeed",
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="kernels-community/flash-attn2"))),
         ["sp_attn_implementation='kernels-community/flash-attn2'"]),
    ],
    ids=["cp_size", "disagreeing_size", "disagreeing_mode", "with_tp", "unknown_attention"],
)  # fmt: skip
def test_requests_we_cannot_honour_fail_at_construction(tmp_path, fields, fragments):
    with pytest.raises(ValueError) as info:
        make(SimPODisRMConfig, tmp_path, **fields)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process, the same micro-batches (the ring of 2 is the whole world: one data-parallel replica)."""
    tokenizer, out, states = build_chat_tokenizer(), tmp_path_factory.mktemp("reference"), {}
    for kind, num_rejected, overrides in worker.ACCELERATE_RUNS:
        trainer = worker.mode_trainer(kind, out / kind, tokenizer, num_rejected, sequence_parallel_size=1, **overrides)
        trainer.train()
        states[kind] = worker.final_state(trainer)
    return states


def check(state, reference, what):
    assert state["global_step"] == reference["global_step"] == worker.TRAIN_STEPS, what
    assert_state_close(state["params"], reference["params"], what)
    got, want = [log["loss"] for log in state["logs"]], [log["loss"] for log in reference["logs"]]
    assert got == pytest.approx(want, abs=1e-5), what


@pytest.mark.slow
def test_parallelism_config_object_trains_like_one_process(tmp_path, references):
    run_on_gloo_ranks(worker.gloo_worker, 2, str(tmp_path), ["accelerate_config"], timeout=900, preload=PRELOAD)
    check(torch.load(tmp_path / "accelerate_config_sft.pt", weights_only=False), references["sft"], "sft")


@pytest.mark.slow
def test_accelerate_yaml_sp_size_under_zero2_trains_like_one_process(tmp_path, references):
    """The route that crashed inside accelerate/DeepSpeed before: an accelerate YAML with DeepSpeed ZeRO-2 and a
    `parallelism_config` section (sp_size 2), launched with `accelerate launch`."""
    yaml = (ROOT / "accelerate_configs" / "cpu_zero2.yaml").read_text()
    yaml += "parallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: deepspeed\n"
    config = tmp_path / "zero2_sp2.yaml"
    config.write_text(yaml)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
               "2", "--main_process_port", str(find_free_port()), str(ROOT / "tests" / "sp_trainer_worker.py"),
               "--out_dir", str(tmp_path), "--task", "accelerate_yaml"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for kind, _, _ in worker.ACCELERATE_RUNS:
        state = torch.load(tmp_path / f"accelerate_yaml_{kind}.pt", weights_only=False)
        assert "DEEPSPEED" in state["distributed_type"], kind
        check(state, references[kind], kind)
