"""The demo pipeline (`python -m trl_longrm.demo`) at a small size: the DisRM stage through `trl-longrm train` on a
ring of 2 CPU processes, evaluated before and after (and better after), and a second run that resumes instead of
redoing the work."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trl_longrm.demo import DemoConfig, run_demo, summary_table


def weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    assert out, f"no weights in {directory}"
    return out


GAIN = 0.15


@pytest.mark.slow
def test_demo_disrm_stage_trains_on_a_ring_learns_and_resumes(tmp_path):
    # A smaller demo: its DisRM stage only, through the demo's recipe (ring of 2), on 3000 training groups instead of
    # 7000 (375 steps, ~2 min instead of ~4.5).
    config = DemoConfig(output_dir=str(tmp_path / "demo"), stages=["simpo_disrm"], num_train=3000)
    summary = run_demo(config)
    root = Path(config.output_dir)

    assert set(summary["models"]) == {"disrm", "simpo_disrm"}
    for name in ("disrm", "simpo_disrm"):
        written = json.loads((root / "eval" / name / "results.json").read_text())
        row = summary["models"][name]
        # 7 tasks x 3 length buckets x (8 PairWise + 3 BestOfN) records, every one judged by the DisRM.
        assert row["records"] == written["counts"]["records"] == 7 * 3 * 11
        assert row["pairwise_avg"] == written["pairwise_avg"] and row["auc"] == written["auc"]
        assert row["model_type"] == "DisRM" and row["unparseable"] == 0
    table = summary_table(summary)
    assert "DisRM trained (Bradley-Terry, ring 2)" in table and f"{100 * row['pairwise_avg']:.1f}" in table

    # It learnt: the held-out benchmark's pairwise accuracy rises well above the random base model's (51.2% -> 73.8%
    # with these 3000 groups; the full demo's 7000 reach 95.2%, see the README), and so does the AUC.
    base, trained = summary["models"]["disrm"], summary["models"]["simpo_disrm"]
    assert trained["pairwise_avg"] >= base["pairwise_avg"] + GAIN, (base, trained)
    assert trained["auc"] > base["auc"], (base, trained)

    # Training ran on the ring of 2 processes the recipe names, one pass over 3000 groups / 8 per step, and moved the
    # weights.
    state = json.loads((root / "runs" / "simpo_disrm" / "trainer_state.json").read_text())
    assert state["global_step"] == 3000 // 8
    base, trained = weights(root / "models" / "tiny-llama-cls"), weights(root / "runs" / "simpo_disrm")
    assert any(not torch.equal(base[n], trained[n]) for n in base)
    assert (root / "length_accuracy.png").stat().st_size > 0

    # A second run finds everything done: no retraining (same files), the same results.
    model_file = next((root / "runs" / "simpo_disrm").glob("*.safetensors"))
    mtime = model_file.stat().st_mtime_ns
    again = run_demo(config)
    assert model_file.stat().st_mtime_ns == mtime
    assert again["models"] == summary["models"]
    assert "train simpo_disrm" in again["timings_s"] and again["timings_s"]["train simpo_disrm"] < 1.0


def test_demo_output_dir_made_with_other_settings_is_refused_not_reused(tmp_path):
    from trl_longrm.demo import SETTINGS_FILE, Demo

    root = tmp_path / "demo"
    Demo(DemoConfig(output_dir=str(root))).check_settings()
    written = json.loads((root / SETTINGS_FILE).read_text())
    assert written["hidden_size"] == DemoConfig().hidden_size and written["data"]["keys_per_question"] == 3
    # The same settings (other stages or evaluation flags only) resume.
    Demo(DemoConfig(output_dir=str(root), stages=["simpo_disrm"], eval_batch_size=4)).check_settings()
    # Other model or data settings, or other recipe flags, are refused, naming what differs.
    for change, key in (({"hidden_size": 64}, "hidden_size"), ({"num_train": 10}, "num_train")):
        with pytest.raises(ValueError, match=key):
            Demo(DemoConfig(output_dir=str(root), **change)).check_settings()
    with pytest.raises(ValueError, match="train_overrides"):
        Demo(DemoConfig(output_dir=str(root), train_overrides={"sft": ["--max_steps", "3"]})).check_settings()
    assert json.loads((root / SETTINGS_FILE).read_text()) == written  # the record is not overwritten

    # Outputs of an older demo (no settings file) are refused too.
    old = tmp_path / "old"
    (old / "models").mkdir(parents=True)
    with pytest.raises(ValueError, match="older version"):
        Demo(DemoConfig(output_dir=str(old))).check_settings()


def test_demo_stages_run_in_pipeline_order_and_sft_needs_the_disrm():
    assert DemoConfig(stages=["simpo_grm", "sft", "simpo_disrm"]).stages == ["simpo_disrm", "sft", "simpo_grm"]
    with pytest.raises(ValueError, match="simpo_disrm"):
        DemoConfig(stages=["sft"])
    with pytest.raises(ValueError, match="add `sft`"):
        DemoConfig(stages=["simpo_disrm", "simpo_grm"])


def test_judge_base_is_the_trained_disrm_backbone_under_a_seeded_lm_head(tmp_path):
    from trl_longrm.demo import Demo, demo_tokenizer
    from trl_longrm.testing_utils import save_tiny_model

    runs = []
    for name in ("a", "b"):
        demo = Demo(DemoConfig(output_dir=str(tmp_path / name), seed=3))
        save_tiny_model(demo.models["simpo_disrm"], "llama", "seq-cls", seed=1, tokenizer=demo_tokenizer())
        demo.judge_base()
        runs.append(demo)
    disrm = weights(runs[0].models["simpo_disrm"])
    judge = weights(runs[0].models["judge"])
    backbone = {n: t for n, t in disrm.items() if not n.startswith("score.")}
    assert backbone and all(torch.equal(judge[n], t) for n, t in backbone.items())
    # The new LM head: present, not the DisRM's embedding, and the same for the same seed.
    assert judge["lm_head.weight"].shape == disrm["model.embed_tokens.weight"].shape
    assert not torch.equal(judge["lm_head.weight"], disrm["model.embed_tokens.weight"])
    assert torch.equal(judge["lm_head.weight"], weights(runs[1].models["judge"])["lm_head.weight"])
