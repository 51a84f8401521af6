"""The step-time model (`trl_longrm.memory_plan.step_time`): its coefficients are the fit of the committed GPU runs
(`bench/step_time_calibration.py`), its leave-one-out error on them is what docs quote, and each setting moves the
term it should (checkpointing's recompute, selective checkpointing's attention, fused LoRA's and Liger's elementwise
passes, offload's transfers, sequence parallelism's share and collectives)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trl_longrm.memory_plan import GroupShape
from trl_longrm.memory_plan.shapes import model_config_file
from trl_longrm.memory_plan.step_time import (
    COEFFICIENTS,
    StepSettings,
    estimate_step_seconds,
    replace,
    settings_of,
    step_terms,
)


BENCH = Path(__file__).resolve().parents[1] / "bench"
RESULTS = BENCH / "results" / "step_time_model.json"


def llama_8b():
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in json.loads(model_config_file("llama-3.1-8b").read_text()).items()
                          if k not in ("architectures", "model_type", "torch_dtype")})  # fmt: skip


def test_coefficients_are_the_fit_of_the_committed_gpu_runs():
    """A fresh fit on the committed reports gives the module's coefficients, and the published leave-one-out errors
    are those of this fit (so neither goes stale when a report is added)."""
    sys.path.insert(0, str(BENCH))
    import step_time_calibration as calibration

    rows = calibration.runs()
    for row in rows:
        terms = step_terms(row["config"], row["stage"], row["shape"], row["settings"], row["card"])
        row["features"] = terms.features()
        row["target"] = row["measured_seconds"] - terms.offload - terms.communication
    fitted = calibration.fit(rows)
    assert fitted == pytest.approx(COEFFICIENTS, rel=1e-9)
    published = json.loads(RESULTS.read_text())
    assert published["coefficients"] == pytest.approx(COEFFICIENTS, rel=1e-9) and published["runs"] == len(rows)
    assert published["leave_one_out_median_abs_rel_error"] < 0.1


def test_each_setting_moves_its_term():
    config, shape = llama_8b(), GroupShape(32768, 256, 4)
    base = StepSettings(lora_r=8)

    def terms(**changes):
        return step_terms(config, "simpo_disrm", shape, replace(base, **changes), "h200")

    plain = terms()
    assert terms(unchecked_layers=16).gemm < plain.gemm and terms(unchecked_layers=32).gemm < terms(unchecked_layers=16).gemm
    assert terms(gradient_checkpointing=False).gemm == terms(unchecked_layers=32).gemm
    assert terms(selective=True).attention < plain.attention and terms(selective=True).gemm == plain.gemm
    assert terms(fused_lora=True).elementwise < plain.elementwise
    liger = terms(use_liger_kernel=True)
    assert liger.elementwise == 0 and liger.elementwise_liger == plain.elementwise
    assert terms(checkpoint_offload=True).offload > 0 == plain.offload
    assert terms(lora_r=0).gemm > plain.gemm  # full fine-tuning computes the weights' gradients too
    ring = terms(sequence_parallel_size=8, world_size=8)
    assert ring.gemm == pytest.approx(plain.gemm / 8) and ring.communication > 0 == plain.communication
    # The run measured on an H200 (bench/results/gpu/h200/levers/: 6.10 s by default, 4.42 s with every lever).
    default = estimate_step_seconds(config, "simpo_disrm", GroupShape(32768, 192, 4), base, "h200")
    best = estimate_step_seconds(config, "simpo_disrm", GroupShape(32768, 192, 4),
                                 replace(base, selective=True, use_liger_kernel=True, fused_lora=True,
                                         unchecked_layers=15), "h200")  # fmt: skip
    assert default == pytest.approx(6.10, rel=0.1) and best == pytest.approx(4.42, rel=0.1)


def test_rows_and_accumulation_scale_a_groups_terms_and_recur_per_micro_batch():
    """By hand: 2 groups a micro-batch, 3 micro-batches a step: what one group computes (matmuls, attention, elementwise,
    offload, sequence parallelism's collectives) times 6; ZeRO-3's collectives times 3; the fitted constant once."""
    config, shape = llama_8b(), GroupShape(32768, 256, 4)
    base = StepSettings(lora_r=8, checkpoint_offload=True, sequence_parallel_size=2, world_size=8, zero_stage=3)
    one = step_terms(config, "simpo_disrm", shape, base, "h200")
    zero_only = step_terms(config, "simpo_disrm", shape, replace(base, sequence_parallel_size=1), "h200")
    ring_only = step_terms(config, "simpo_disrm", shape, replace(base, zero_stage=0), "h200")
    six = step_terms(config, "simpo_disrm", shape, replace(base, rows_per_micro_batch=2, accumulation_steps=3), "h200")
    for name in ("gemm", "attention", "elementwise", "offload"):
        assert getattr(six, name) == pytest.approx(6 * getattr(one, name), rel=1e-12), name
    assert six.communication == pytest.approx(6 * ring_only.communication + 3 * zero_only.communication, rel=1e-12)
    assert six.micro_steps == 3 and six.features()[-1] == 1.0
    extra = six.seconds - 6 * (one.seconds - COEFFICIENTS["step"] - zero_only.communication)
    assert extra == pytest.approx(COEFFICIENTS["step"] + 3 * zero_only.communication, rel=1e-9)
    # A trainer config's batch and accumulation are read as the run takes them.
    from types import SimpleNamespace

    args = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=3, activation_checkpointing=True)
    settings = settings_of(args)
    assert (settings.rows_per_micro_batch, settings.accumulation_steps) == (2, 3)
