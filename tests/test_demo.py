"""The demo pipeline (`python -m trl_longrm.demo`) at a small size, over two seeds: the DisRM stage through
`trl-longrm train` on a ring of 2 CPU processes, then the judge's SFT and SimPO stages, each evaluated and each
learning; and a second run that resumes instead of redoing the work."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trl_longrm.demo import DISRM_TRAIN_FACTOR, SMALL_DEMO, DemoConfig, run_demo, summary_table


def weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    assert out, f"no weights in {directory}"
    return out


# The reduced demo (`SMALL_DEMO`: 1400 examples per judge set, 2100 DisRM groups = 263 steps on the ring of 2, SFT 350
# steps, SimPO-GRM 50 steps, no base-model evaluations). What it must show in every seed and on any machine (the full
# demo's figures are in the README): the DisRM and the judge after SFT well above chance, stage II close to stage I.
# The floors were set about 10 points below the lowest of 10 runs of an earlier size (2400 examples), seeds 0-4 on two
# CPU kernel profiles (native AVX-512 and forced AVX2, whose rounding differs: `bench/demo_seeds.py`,
# `bench/results/demo_seeds.json`): DisRM 81.0% (seed 3), judge after SFT 76.2% (seed 3, both profiles), stage II at
# most 3.0 points below stage I (seed 3, native). At 1400 examples (issue 43: the suite's time), seeds 0 / 1, the ones
# run here: DisRM 94.6 / 95.8 native, 95.8 / 98.8 AVX2; after SFT 82.7 / 95.2 native, 83.9 / 89.9 AVX2; stage II 2.4 /
# 1.8 points below stage I native, 3.0 / 1.2 AVX2 (seeds 2-4 not re-run at this size). Before the tiny DisRM recipe
# took `pairwise` rejection and reward centering, the lowest DisRM of seeds 0-4 was 59.5% on this machine, and seed 1
# fell from 86.9% to 75.6% (here) or 57.1% (another machine) with the machine's rounding.
DISRM_MIN = 0.70
SFT_MIN = 0.65
STAGE_II_DROP = 0.06
# Judgments without a score (counted as wrong): none after SFT in the 10 runs; after stage II's 50 steps at most 1 of
# 168 (2400 examples, native seeds 0 and 1: a 16K record whose judgment repeats its count line instead of scoring); none
# in the four runs at 1400.
STAGE_II_MAX_UNPARSED = 3


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_demo_learns_at_every_stage_whatever_the_seed(tmp_path, seed):
    config = DemoConfig(output_dir=str(tmp_path / "demo"), seed=seed, **SMALL_DEMO)
    summary = run_demo(config)
    root = Path(config.output_dir)
    models = summary["models"]
    print(f"seed {seed}:", {name: (row["pairwise_avg"], row["auc"], row["unparseable"]) for name, row in models.items()})

    assert set(models) == {"simpo_disrm", "sft", "simpo_grm"}
    for name, row in models.items():
        # The judges are evaluated on PairWise only: a subset run's results file names its tasks and formats.
        written = json.loads(next((root / "eval" / name).glob("results*.json")).read_text())
        assert row["pairwise_avg"] == written["pairwise_avg"] and row["auc"] == written["auc"]
        # 7 tasks x 3 length buckets x 8 PairWise records (+ 3 BestOfN for the DisRM), every one judged.
        assert row["records"] == written["counts"]["records"] == 7 * 3 * (11 if name == "simpo_disrm" else 8)
    table = summary_table(summary)
    assert "DisRM trained (Bradley-Terry, ring 2)" in table and f"{100 * models['sft']['pairwise_avg']:.1f}" in table

    disrm, sft, simpo = (models[name] for name in ("simpo_disrm", "sft", "simpo_grm"))
    assert disrm["pairwise_avg"] >= DISRM_MIN and disrm["auc"] > 0.5, disrm
    assert sft["pairwise_avg"] >= SFT_MIN and sft["unparseable"] == 0, sft
    assert simpo["pairwise_avg"] >= sft["pairwise_avg"] - STAGE_II_DROP, (sft, simpo)
    assert simpo["unparseable"] <= STAGE_II_MAX_UNPARSED, simpo

    # The DisRM trained on the ring of 2 processes the recipe names, one pass over 1.5 x 1400 groups / 8 per step (the
    # last step's batch short), and moved the weights.
    state = json.loads((root / "runs" / "simpo_disrm" / "trainer_state.json").read_text())
    assert state["global_step"] == math.ceil(round(DISRM_TRAIN_FACTOR * SMALL_DEMO["num_train"]) / 8) == 263
    base, trained = weights(root / "models" / "tiny-llama-cls"), weights(root / "runs" / "simpo_disrm")
    assert any(not torch.equal(base[n], trained[n]) for n in base)
    assert (root / "length_accuracy.png").stat().st_size > 0

    if seed == 0:
        # A second run finds everything done: no retraining (same files), the same results.
        files = {stage: next((root / "runs" / stage).glob("*.safetensors")) for stage in ("simpo_disrm", "sft")}
        mtimes = {stage: path.stat().st_mtime_ns for stage, path in files.items()}
        again = run_demo(config)
        assert {stage: path.stat().st_mtime_ns for stage, path in files.items()} == mtimes
        assert again["models"] == summary["models"]
        assert all(again["timings_s"][f"train {stage}"] < 1.0 for stage in ("simpo_disrm", "sft", "simpo_grm"))


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


def test_the_disrm_set_defaults_to_one_and_a_half_judge_sets_and_can_be_set(tmp_path):
    from trl_longrm.demo import Demo

    assert Demo(DemoConfig(output_dir=str(tmp_path), num_train=2400)).disrm_groups == round(DISRM_TRAIN_FACTOR * 2400)
    demo = Demo(DemoConfig(output_dir=str(tmp_path), num_train=2400, num_train_disrm=7200))
    assert demo.disrm_groups == 7200 and demo.settings()["num_train_disrm"] == 7200


def test_demo_cli_parses_every_field_as_the_python_api_types_it():
    """`--num-train-disrm` (`int | None`) is an int on the command line too (it was refused as a `NoneType` value)."""
    from trl_longrm.demo import build_parser

    args = build_parser().parse_args(["--num-train-disrm", "50", "--num-train", "30", "--no-evaluate-base-models"])
    assert args.num_train_disrm == 50 and args.num_train == 30 and args.evaluate_base_models is False
    assert DemoConfig(**vars(args)).num_train_disrm == 50
    assert build_parser().parse_args([]).num_train_disrm is None
