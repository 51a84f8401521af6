"""The three LongRM trainers with sequence parallelism on gloo ranks against single-process runs on the same data.

- One step, ring = world (2 and 4 ranks): the loss and the world-averaged parameter gradients (what DDP applies)
  equal the `sequence_parallel_size=1` step on the same packed row, whose documents cross slice boundaries and whose
  length is not a multiple of the ring size.
- World 4 = 2 data-parallel replicas x rings of 2: a few `trainer.train()` steps end with the weights of a single
  process that sees the same global batches (twice the micro-batch), under DDP and under DeepSpeed ZeRO-2.
The workers live in `sp_trainer_worker.py`; the references here are built with the same builders.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sp_trainer_worker as worker
import torch

from trl_longrm.sequence_parallel.launch import find_free_port, run_on_gloo_ranks
from trl_longrm.testing_utils import build_chat_tokenizer


ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("trl_longrm.testing_utils",)  # the fork server is shared with the other gloo tests: same list


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def document_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    ends = [*starts[1:], position_ids.shape[1]]
    return list(zip(starts, ends))


def assert_state_close(got: dict, want: dict, what: str, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_one_step_equals_single_process(tmp_path, tokenizer, world_size):
    tasks = ["step", "bad_configs"] if world_size == 2 else ["step"]
    run_on_gloo_ranks(worker.gloo_worker, world_size, str(tmp_path), tasks, timeout=900, preload=PRELOAD)
    for kind in worker.KINDS:
        ring = torch.load(tmp_path / f"step_{kind}_world{world_size}.pt", weights_only=False)
        reference = worker.one_step(
            worker.step_trainer(kind, tmp_path / f"ref_{kind}", tokenizer, sequence_parallel_size=1)
        )
        # The case we claim: the same row, not a multiple of the ring size, documents crossing slice boundaries.
        torch.testing.assert_close(ring["input_ids"], reference["input_ids"], rtol=0, atol=0)
        length = reference["input_ids"].shape[1]
        assert length % world_size, f"{kind}: row of {length} tokens is a multiple of {world_size}; change the data"
        slice_len = -(-length // world_size)
        cuts = range(slice_len, length, slice_len)
        crossing = [b for b in document_bounds(reference["position_ids"]) if any(b[0] < c < b[1] for c in cuts)]
        assert len(crossing) >= world_size - 1, f"{kind}: no document crosses a slice boundary"

        torch.testing.assert_close(ring["loss"], reference["loss"], atol=1e-5, rtol=1e-5, msg=f"{kind} loss")
        assert_state_close(ring["grads"], reference["grads"], f"{kind} grad")
        assert len(reference["grads"]) > 10
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies"):
            if name in reference["metrics"]:
                assert ring["metrics"][name] == pytest.approx(reference["metrics"][name], abs=1e-5), name

    if world_size == 2:
        errors = torch.load(tmp_path / "bad_configs_world2.pt", weights_only=False)
        assert errors["size_not_dividing_world"][0] == "ValueError"
        assert "divide" in errors["size_not_dividing_world"][1]
        assert errors["bad_stride"][0] == "ValueError" and "ring_head_stride" in errors["bad_stride"][1]
        kind, message = errors["flash_without_flash_attn"]
        assert kind in ("ImportError", "ValueError") and "flash" in message.lower()


def assert_user_figures_match(got: dict, want: dict, what: str, data_parallel_size: int) -> None:
    """Every figure a user reads from a sequence-parallel run (`worker.final_state`) equals one process's on the same
    global batches: each logged metric and counter (`num_input_tokens_seen`, `num_tokens`, the rewards and
    accuracies, `mean_token_accuracy`, ...), the token count behind the logged tokens per second, `total_flos`,
    `evaluate()`'s metrics, the predictions `compute_metrics` receives, and `predict()`'s outputs."""
    assert len(got["logs"]) == len(want["logs"]), what
    for step, (log, reference) in enumerate(zip(got["logs"], want["logs"])):
        assert log.keys() == reference.keys(), (what, step, sorted(log.keys() ^ reference.keys()))
        for name, value in reference.items():
            assert log[name] == pytest.approx(value, rel=1e-4, abs=1e-5), (what, step, name, log[name], value)
    seen = [log["num_input_tokens_seen"] for log in want["logs"]]
    assert seen[0] > 0, what
    # Rounded to 4 decimals by transformers' speed_metrics: the product is the count within a fraction of a percent.
    assert got["timed_tokens"] == pytest.approx(seen, rel=5e-3), (what, "tokens behind train_tokens_per_second")
    assert got["total_flos"] == pytest.approx(want["total_flos"], rel=1e-6), (what, "total_flos")
    assert got["eval"].keys() == want["eval"].keys(), (what, sorted(got["eval"].keys() ^ want["eval"].keys()))
    for name, value in want["eval"].items():
        if name == "eval_loss" and " sft" in f" {what}" and data_parallel_size > 1:
            # The HF Trainer averages each replica's loss, and SFT's loss is a token mean per micro-batch: with 2
            # replicas, the mean of two token means (as stock SFTTrainer under DDP), not one process's token mean.
            # Its token-weighted `eval_nll` is compared.
            continue
        assert got["eval"][name] == pytest.approx(value, rel=1e-4, abs=1e-5), (what, name, got["eval"][name], value)
    if "compute_metrics_inputs" in want:
        assert want["eval"]["eval_predictions_seen"] == worker.EVAL_GROUPS, what
        for mine, reference in zip(got["compute_metrics_inputs"], want["compute_metrics_inputs"], strict=True):
            np.testing.assert_allclose(mine, reference, rtol=1e-4, atol=1e-5, err_msg=f"{what} compute_metrics input")
    # SFT predicts the logits of its packed rows, laid out by the micro-batch: comparable with one replica only.
    if "compute_metrics_inputs" in want or data_parallel_size == 1:
        predictions, labels = got["predict"]
        assert predictions.shape == want["predict"][0].shape, (what, "predict()")
        if "compute_metrics_inputs" in want:
            assert predictions.shape[0] == worker.PREDICT_GROUPS, what
        np.testing.assert_allclose(predictions, want["predict"][0], rtol=1e-4, atol=1e-5, err_msg=f"{what} predict()")
        np.testing.assert_array_equal(labels, want["predict"][1], err_msg=f"{what} predict() labels")


def single_process_training(kind, tmp_path, tokenizer) -> dict:
    """What 2 data-parallel replicas of micro-batch b train on, seen by one process as micro-batch 2b."""
    trainer = worker.train_trainer(
        kind,
        tmp_path / f"ref_train_{kind}",
        tokenizer,
        sequence_parallel_size=1,
        per_device_train_batch_size=2 * worker.TRAIN_BATCH,
        per_device_eval_batch_size=2 * worker.EVAL_BATCH,
    )
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    state = worker.final_state(trainer)
    state["initial"] = initial
    return state


def check_training(result: dict, reference: dict, kind: str, distributed_type: str) -> None:
    assert result["num_processes"] == 4 and distributed_type in result["distributed_type"]
    assert result["global_step"] == reference["global_step"] == worker.TRAIN_STEPS
    assert_state_close(result["params"], reference["params"], f"{kind} after training")
    # Training moved the weights, so equality is not that of two untouched models.
    moved = [n for n, p in reference["params"].items() if (p - reference["initial"][n]).abs().max() > 1e-4]
    assert len(moved) > len(reference["params"]) // 2, kind
    losses = [log["loss"] for log in result["logs"]]
    want = [log["loss"] for log in reference["logs"]]
    assert losses == pytest.approx(want, abs=1e-5), kind
    assert_user_figures_match(result, reference, f"{kind} {distributed_type}", data_parallel_size=2)


@pytest.mark.slow
def test_training_two_replicas_of_two_ring_ranks_ddp(tmp_path, tokenizer):
    """Rings of 2 for the three trainers; Ulysses pairs for the DisRM (2 replicas of the all-to-all groups)."""
    tasks = ["train", "train@ulysses:disrm"]
    run_on_gloo_ranks(worker.gloo_worker, 4, str(tmp_path), tasks, timeout=1200, preload=PRELOAD)
    for kind, tag in [*((k, "ddp") for k in worker.KINDS), ("disrm", "ddp_ulysses")]:
        result = torch.load(tmp_path / f"train_{kind}_{tag}.pt", weights_only=False)
        check_training(result, single_process_training(kind, tmp_path, tokenizer), f"{kind} {tag}", "MULTI_CPU")


@pytest.mark.slow
def test_training_two_replicas_of_two_ring_ranks_deepspeed_zero2(tmp_path, tokenizer):
    kinds = ["grm", "disrm"]  # SFT goes through the same mixin; two trainers keep the launch short
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / "cpu_zero2.yaml"),
        "--num_processes",
        "4",
        "--main_process_port",
        str(find_free_port()),
        str(ROOT / "tests" / "sp_trainer_worker.py"),
        "--out_dir",
        str(tmp_path),
        "--task",
        "train",
        "--sequence_parallel_size",
        "2",
        "--kinds",
        *kinds,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for kind in kinds:
        state = torch.load(tmp_path / f"train_{kind}_deepspeed.pt", weights_only=False)
        check_training(state, single_process_training(kind, tmp_path, tokenizer), kind, "DEEPSPEED")
