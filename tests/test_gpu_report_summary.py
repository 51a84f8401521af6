"""`bench/gpu_longest_row.py`'s summary of a GPU report (what `summary.json` publishes), on hand-made reports: a GPU
call is rare, so a report it returns must not fail to summarise."""

import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def long_rows_attempt(length, long_rows, status, peak_gib=None, steps=()):
    record = {"trainer": "grm", "impl": "ours", "prompt_length": length, "long_rows": long_rows, "status": status}
    if status == "ok":
        record.update(peak_mem_bytes=int(peak_gib * 2**30), step_seconds=list(steps))
    return record


@pytest.fixture
def summary():
    from gpu_longest_row import summary

    return summary


def test_long_rows_pairs_are_summarised_by_how_they_ended(summary):
    report = {"gpu": "H100", "versions": {}, "throughput": [], "longest_row": [], "long_rows": [
        # Both train (three steps each): the memory ratio and the median step after the first.
        long_rows_attempt(65536, False, "ok", 11.7, (9.0, 8.3, 8.2, 8.4)),
        long_rows_attempt(65536, True, "ok", 7.2, (9.5, 8.8, 8.7, 8.75)),
        # One step each: the memory ratio only.
        long_rows_attempt(131072, False, "ok", 20.0, (30.0,)),
        long_rows_attempt(131072, True, "ok", 12.0, (31.0,)),
        # Past what trains without the long-row settings: how each ended, and the peak of the one that trained.
        long_rows_attempt(557056, False, "oom"),
        long_rows_attempt(557056, True, "ok", 39.0, (150.0,)),
        # One of a pair only (a call cut short): nothing.
        long_rows_attempt(1048576, True, "timeout"),
    ]}  # fmt: skip
    out = summary(report)
    assert out["long_rows_peak_ratio_65536"] == pytest.approx(7.2 / 11.7, rel=1e-6)
    assert out["long_rows_step_ratio_65536"] == pytest.approx(8.75 / 8.3)
    assert out["long_rows_peak_ratio_131072"] == pytest.approx(12.0 / 20.0, rel=1e-6)
    assert "long_rows_step_ratio_131072" not in out
    assert out["long_rows_status_557056"] == {"without": "oom", "with": "ok"}
    assert out["long_rows_peak_gib_557056"] == 39.0
    assert not any(key.endswith("1048576") for key in out)


def test_long_rows_brackets_and_the_cap_are_summarised(summary):
    """Per setting, the longest prompt that trained and the shortest that ran out of memory (the bracket of the
    longest row a GPU trains), and the allocator cap the report's runs had."""
    report = {"gpu": "H100", "versions": {}, "throughput": [], "longest_row": [], "memory_cap_gib": 16.0,
              "long_rows": [
                  long_rows_attempt(98304, False, "oom"), long_rows_attempt(98304, True, "ok", 7.3, (18.0,)),
                  long_rows_attempt(163840, True, "ok", 11.6, (38.0,)), long_rows_attempt(212992, True, "oom"),
                  long_rows_attempt(73728, False, "ok", 10.6, (8.0,)), long_rows_attempt(262144, True, "oom"),
                  long_rows_attempt(300000, True, "timeout"),
              ]}  # fmt: skip
    out = summary(report)
    assert (out["long_rows_longest_ok_without"], out["long_rows_first_oom_without"]) == (73728, 98304)
    assert (out["long_rows_longest_ok_with"], out["long_rows_first_oom_with"]) == (163840, 212992)
    assert out["memory_cap_gib"] == 16.0
    assert out["long_rows_status_98304"] == {"without": "oom", "with": "ok"}


def test_plan_comparison_reads_each_runs_kernels_steps_and_cap():
    """`gpu_plan_vs_measured.py` plans a run with the attention kernels it recorded (a run that ran out of memory
    recorded none before this commit: the report's others), compares a one-step run with the plan's first step, and
    a capped report's runs with the cap plus the CUDA context (which is not the allocator's)."""
    from gpu_plan_vs_measured import attention_of, device_bytes_of, report_steps

    from trl_longrm.memory_plan.plan import CUDA_CONTEXT_BYTES

    cudnn = {"kernels": ["shared rows: torch_cudnn_shared_prefix", "torch_cudnn (ops: torch_cudnn)"]}
    varlen = {"kernels": ["torch_varlen (ops: torch_varlen)"]}
    assert attention_of(cudnn) == "cudnn" and attention_of(varlen) == "flash_attn"
    assert attention_of({"status": "oom"}, {"long_rows": [{"status": "oom"}, cudnn]}) == "cudnn"
    assert attention_of({"status": "oom"}) == "flash_attn"
    assert report_steps({"command": "python3 bench/gpu_longest_row.py --steps 1 --timeout 120"}) == 1
    assert report_steps({"command": "python3 bench/gpu_longest_row.py --steps=2"}) == 2
    assert report_steps({"command": "python3 bench/gpu_longest_row.py --timeout 120"}) == 3
    assert device_bytes_of({"gpu_memory_gib": 79.2}) == int(79.2 * 2**30)
    assert device_bytes_of({"gpu_memory_gib": 79.2, "memory_cap_gib": 16.0}) == 16 * 2**30 + CUDA_CONTEXT_BYTES
    assert device_bytes_of({"gpu_memory_gib": 79.2}, memory_cap_gib=8.0) == 8 * 2**30 + CUDA_CONTEXT_BYTES


def variant_run(variant, status, tokens_per_s=None, mfu=None, peak_gib=None, length=32768, k=1):
    record = {"trainer": "grm", "impl": "ours", "prompt_length": length, "num_rejected": k, "status": status,
              **({"variant": variant} if variant != "default" else {})}  # fmt: skip
    if status == "ok":
        record.update(tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_bytes=int(peak_gib * 2**30))
    return record


def test_variants_are_summarised_beside_the_default_of_the_same_report(summary):
    """`--variants` (selective checkpointing, Liger's kernels): each one's MFU at 32K, its tokens/s and peak over the
    default run's, or how it ended; the default's figures (and the ours / stock ratios) are the default run's only."""
    report = {"gpu": "H100", "versions": {}, "longest_row": [], "long_rows": [], "throughput": [
        variant_run("default", "ok", 30000.0, 0.24, 7.2),
        variant_run("selective", "ok", 33000.0, 0.264, 7.9),
        variant_run("liger", "error"),
        variant_run("selective_liger", "ok", 36000.0, 0.288, 7.5),
        variant_run("selective", "ok", 9000.0, 0.5, 1.0, length=8192),  # not at 32K: not summarised
        {**variant_run("default", "ok", 20000.0, 0.1, 3.0), "impl": "stock"},
    ], "variant_profiles": {"selective_liger": {"profile": {"kernel_share": {"attention": 0.6}, "device_busy_fraction":
                                                            0.9, "mfu_if_never_idle": 0.31, "step_wall_seconds": 1.8}}}}  # fmt: skip
    out = summary(report)
    assert out["mfu_32k_grm"] == out["mfu_32k"] == 0.24
    assert out["tokens_per_s_ratio_grm"] == pytest.approx(30000 / 20000)
    assert out["mfu_32k_grm_selective"] == 0.264
    assert out["tokens_per_s_ratio_32k_grm_selective_vs_default"] == pytest.approx(1.1)
    assert out["peak_ratio_32k_grm_selective_vs_default"] == pytest.approx(7.9 / 7.2, rel=1e-6)
    assert out["variant_status_32k_grm_liger"] == "error"
    assert out["tokens_per_s_ratio_32k_grm_selective_liger_vs_default"] == pytest.approx(1.2)
    assert out["profile_selective_liger"]["mfu_if_never_idle"] == 0.31


def test_plan_comparison_plans_a_variant_with_its_settings():
    """A variant's run (`mfu_variants.json`) is planned with its settings: selective checkpointing keeps attention
    outputs the default run does not."""
    from gpu_plan_vs_measured import training_args

    assert training_args("grm", "ours", 1024, variant="selective").activation_checkpointing_kwargs == {"selective": True}
    assert not training_args("grm", "ours", 1024).activation_checkpointing_kwargs


def test_long_rows_and_a_selective_variant_merge_their_checkpointing_kwargs():
    """`--long-rows` with a selective variant: both set `gradient_checkpointing_kwargs` (offload, selective), which are
    merged into one dict (a TypeError for a keyword given twice before), in the run's plan and in its arguments."""
    from gpu_plan_vs_measured import training_args

    merged = {"use_reentrant": False, "offload": True, "selective": True}
    args = training_args("grm", "ours", 1024, long_rows=True, variant="selective")
    assert args.activation_checkpointing_kwargs == merged and args.mlp_tile_tokens == 16384

    from gpu_longest_row import run_settings  # what `attempt` gives `common.build_trainer`

    settings = run_settings(long_rows=True, variant="selective_liger")
    assert settings == dict(gradient_checkpointing_kwargs=merged, mlp_tile_tokens=16384, use_liger_kernel=True)
    assert run_settings(long_rows=False, variant="selective") == dict(gradient_checkpointing_kwargs={"selective": True})
    assert run_settings(long_rows=True, variant="default")["gradient_checkpointing_kwargs"] == {
        "use_reentrant": False, "offload": True}


def test_lora_model_flops_count_no_weight_gradients_of_the_frozen_layers():
    """MFU with LoRA (issue 55's convention): frozen matmuls 4 x parameters per token (no weight gradient), the
    adapters 6 x r x (in + out), attention unchanged. By hand for a one-layer shape and one unshared group."""
    from gpu_longest_row import model_flops

    shape = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=4, vocab_size=100)  # fmt: skip
    group = {"prompt_ids": [1] * 3, "chosen_completion_ids": [1, 2], "rejected_completion_ids": [[1]]}
    tokens, pairs = (3 + 2) + (3 + 1), 5 * 6 // 2 + 4 * 5 // 2
    params = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16  # q, k, v, o, gate, up, down
    in_out = (8 + 8) + 2 * (8 + 4) + (8 + 8) + 2 * (8 + 16) + (16 + 8)
    attention = 12 * 8 * pairs
    assert model_flops([group], False, "disrm", shape) == 6 * params * tokens + attention
    assert model_flops([group], False, "disrm", shape, lora_r=2) == (4 * params + 6 * 2 * in_out) * tokens + attention


def test_8b_runs_are_summarised_with_both_mfus_and_kept_apart_from_the_0_6b_figures(summary):
    """`gpu_8b.json`: each 8B run's figures under its own key, MFU against the measured GEMM rate over the same timed
    steps, `mfu_32k_8b` the best 32K run; the 0.6B keys do not take the 8B runs."""
    run = {"trainer": "disrm", "impl": "ours", "prompt_length": 32768, "num_rejected": 4, "model": "llama-3.1-8b",
           "lora_r": 8, "status": "ok", "tokens_per_s": 26000.0, "mfu": 0.30, "peak_mem_bytes": 16 * 2**30,
           "timed_steps": [2, 3], "step_seconds": [9.0, 2.0, 2.0, 5.0], "model_flops_per_step": [1e15, 2e15, 2e15, 2e15]}  # fmt: skip
    long = {**run, "prompt_length": 131072, "long_rows": True, "mfu": 0.31, "peak_mem_bytes": 17 * 2**30}
    grm = {**run, "trainer": "grm", "model": "qwen3-8b", "mfu": 0.28}
    report = {"gpu": "H200", "versions": {}, "longest_row": [], "long_rows": [], "gemm": {"tflops": 800.0},
              "throughput": [run, long, grm, {**grm, "prompt_length": 8192, "status": "oom"}]}  # fmt: skip
    out = summary(report)
    assert out["run_8b_llama-3.1-8b_disrm_32k"]["mfu_vs_measured_gemm"] == pytest.approx(4e15 / 4.0 / 800e12)
    assert out["mfu_32k_8b"] == 0.30 and out["mfu_32k_8b_run"] == "llama-3.1-8b_disrm_32k"
    assert out["tokens_per_s_8b_32k"] == {"llama-3.1-8b_disrm_32k": 26000.0, "qwen3-8b_grm_32k": 26000.0}
    assert out["peak_gib_8b_131k"] == {"llama-3.1-8b_disrm_128k_long_rows": 17.0}
    assert out["status_8b_qwen3-8b_grm_8k"] == "oom"
    assert "mfu_32k_disrm" not in out and "mfu_32k" not in out


def test_plan_comparison_plans_a_lora_run_of_its_model_and_counts_its_adapter():
    """An 8B record is planned on its model's shape (its layer count as the run had it) through its LoRA adapter, and
    the adapter's weights, allocated after the base model the run measures from, are among the planned bytes."""
    from gpu_plan_vs_measured import model_config_of, plan_attempt

    record = {"trainer": "disrm", "impl": "ours", "prompt_length": 256, "num_rejected": 1, "model": "llama-3.1-8b",
              "num_hidden_layers": 1, "lora_r": 8}  # fmt: skip
    config = model_config_of(record)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size) == (
        "llama", 4096, 1, 128256)
    with_adapter = plan_attempt(record, 64)
    r16 = plan_attempt({**record, "lora_r": 16}, 64)
    # r16 adds 8 x (in + out features of a Llama-3.1-8B layer's seven projections) float32 parameters: their weights
    # (4 bytes each), gradients (4) and Adam states (8) where live at the peak; 14.5 bytes each here (on 160a8e5),
    # without the adapter's weights it would be 10.5.
    in_out = 4 * 4096 + 2 * 4096 + 2 * 1024 + 3 * (4096 + 14336)
    assert r16["planned_bytes"] - with_adapter["planned_bytes"] > 8 * in_out * 13
