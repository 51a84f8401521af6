"""What fits my GPUs (`trl-longrm plan`, `trl_longrm.memory_plan.search`): the proposals fit the card with the stated
margin, as a full trace of each plans them (no per-layer extrapolation, no cached trace); a proposal runs on CPU with
its measured peak within 2% of its plan and under the card; a layout that cannot fit is rejected with its planned peak;
`--write` gives a recipe whose `--dry_run` plans the same peak."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types

import pytest
import torch
from test_memory_plan import assert_within, model_config

from trl_longrm.memory_plan import GroupShape, plan_memory
from trl_longrm.memory_plan.search import Cluster, search


SHAPE = GroupShape(2048, 256, 4)
GIB = 2**30


@pytest.fixture(scope="module")
def searched():
    """A 6-layer model's GRM on one CPU 'card' of 0.3 GiB: plain checkpointing fits with room to spare, so the search
    also spends it (selective checkpointing, unchecked layers)."""
    return search("simpo_grm", model_config(layers=6), SHAPE, Cluster.parse("1xcpu", device_memory_gib=0.3),
                  methods=("full",), device="cpu", dtype=torch.float32)  # fmt: skip


def test_proposals_fit_as_full_traces_plan_them_and_spend_spare_memory(searched):
    budget = 0.97 * 0.3 * GIB
    assert searched.proposals, searched.table()
    speeds = [c.tokens_per_s for c in searched.proposals]
    assert speeds == sorted(speeds, reverse=True)
    unchecked = max(searched.proposals, key=lambda c: c.activations.unchecked_layers)
    assert unchecked.activations.unchecked_layers
    # The most unchecked layers that fit (`propose.most_unchecked_layers`): one more does not.
    more = dataclasses.replace(unchecked.activations, unchecked_layers=unchecked.activations.unchecked_layers + 1)
    if more.unchecked_layers <= 6:
        assert searched.planner.plan(unchecked.method, unchecked.layout, more).peak > budget
    assert any(c.activations.selective for c in searched.proposals)
    planner = searched.planner
    for candidate in searched.proposals:
        assert candidate.peak_bytes <= budget
        # Planned again from a full trace of all 6 layers, nothing cached: within 2% and still fitting.
        args = planner.args(candidate.method, candidate.layout, candidate.activations)
        full = plan_memory("simpo_grm", args, planner.config, SHAPE, dtype=torch.float32, max_traced_layers=None)
        assert abs(candidate.peak_bytes / full.peak - 1) < 0.02, (candidate.activations, candidate.peak_bytes, full.peak)
        assert full.peak <= budget


def test_the_fastest_proposal_runs_within_its_plan_and_under_the_card(searched):
    from memory_plan_worker import measure_step

    best = searched.proposals[0]
    args = searched.planner.args(best.method, best.layout, best.activations)
    measured = measure_step("simpo_grm", args, searched.planner.config, SHAPE, None, torch.float32, 1)
    assert measured <= 0.3 * GIB
    assert_within(best.peak_bytes, measured, f"plan search: grm_6_layers {best.activations.describe()}")


def test_rows_per_step_take_the_most_groups_a_micro_batch_that_fit():
    """4 groups a step on the 0.3 GiB card: one a micro-batch accumulated 4 times, and the most a micro-batch that fit
    (2: four are estimated, and planned, over the card): planned again from a full trace within 2%, measured on CPU
    within 2% and under the card; on one process (no ZeRO collectives to repeat) the step-time model gives 2 x 2 and
    1 x 4 the same time."""
    from memory_plan_worker import measure_step

    from trl_longrm.memory_plan.search import Batching

    result = search("simpo_grm", model_config(layers=6), SHAPE, Cluster.parse("1xcpu", device_memory_gib=0.3),
                    methods=("full",), device="cpu", dtype=torch.float32, rows_per_step=4,
                    spend_spare_memory=1)  # fmt: skip
    budget, planner = 0.97 * 0.3 * GIB, result.planner
    assert "4 a step" in result.table()
    assert {c.batching for c in result.proposals} == {Batching(1, 4), Batching(2, 2)}, result.table()
    best = next(c for c in result.proposals if c.batching == Batching(2, 2))
    assert best.peak_bytes <= budget
    plain = next(c for c in result.proposals if c.batching == Batching(1, 4) and c.activations == best.activations)
    assert plain.step_seconds == pytest.approx(best.step_seconds, rel=1e-12)
    assert best.tokens_per_s == pytest.approx(4 * SHAPE.tokens(False, "simpo_grm") / best.step_seconds)
    four = next(c for c in result.rejected if c.batching == Batching(4, 1))
    assert four.estimated and four.peak_bytes > budget
    assert planner.plan(best.method, best.layout, best.activations, batching=Batching(4, 1)).peak > budget
    args = planner.args(best.method, best.layout, best.activations, best.batching)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 2)
    full = plan_memory("simpo_grm", args, planner.config, SHAPE, dtype=torch.float32, max_traced_layers=None)
    assert abs(best.peak_bytes / full.peak - 1) < 0.02 and full.peak <= budget
    measured = measure_step("simpo_grm", args, planner.config, SHAPE, None, torch.float32, 2)
    assert measured <= 0.3 * GIB
    assert_within(best.peak_bytes, measured, "plan search: grm_6_layers, 2 groups a micro-batch x 2")


def test_a_card_too_small_rejects_every_layout_with_its_peak():
    result = search("simpo_grm", model_config(layers=6), SHAPE, Cluster.parse("1xcpu", device_memory_gib=0.02),
                    methods=("full",), device="cpu", dtype=torch.float32, spend_spare_memory=0)  # fmt: skip
    assert not result.proposals
    assert {c.activations for c in result.rejected} and all("over" in c.reason for c in result.rejected)
    assert "nothing fits" in result.table()


@pytest.mark.slow
def test_cli_writes_a_recipe_whose_dry_run_plans_the_same(tmp_path):
    """`trl-longrm plan ... --write` then `trl-longrm train RECIPE --dry_run` (the recipe keeps a base recipe's data)."""
    config = model_config(layers=6)
    config.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    base = tmp_path / "base.yaml"
    base.write_text(f"dataset_name: {data}\noutput_dir: {tmp_path / 'out'}\nreport_to: none\n")
    recipe = tmp_path / "planned.yaml"
    command = [sys.executable, "-m", "trl_longrm", "plan", "--model", str(tmp_path / "model"), "--stage", "simpo_grm",
               "--prompt_tokens", "2048", "--response_tokens", "256", "--num_rejected", "4", "--cards", "1xcpu",
               "--device", "cpu", "--device_memory_gib", "0.3", "--methods", "full", "--write", str(recipe),
               "--recipe", str(base), "--top", "2", "--json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {recipe}" in done.stdout and recipe.read_text().startswith("# coding: trl_longrm")
    result = json.loads(done.stdout[: done.stdout.rindex("wrote")])
    best_peak = result["proposals"][0]["peak_gib"]
    dry = subprocess.run([sys.executable, "-m", "trl_longrm", "train", str(recipe), "--dry_run"], capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    line = next(x for x in dry.stdout.splitlines() if x.startswith("peak of the traced ranks"))
    assert ": fits" in line, dry.stdout[-3000:]
    assert float(line.split()[5]) == pytest.approx(best_peak, abs=0.01)


def test_most_unchecked_layers_is_the_affine_rule_confirmed_by_a_plan():
    """By hand: plans of peak 10 + 3 n (n >= 1) against a budget of 30 give n = 6 (28), from the plans of 1, 2 and 6;
    where the confirming plan does not fit (its top layer differs), n steps down; where one layer does not fit, none."""
    from trl_longrm.memory_plan.propose import most_unchecked_layers

    planned = []

    def plan(n, bump=0):
        planned.append(n)
        return types.SimpleNamespace(peak=10 + 3 * n + (bump if n >= 6 else 0))

    assert most_unchecked_layers(plan, 32, 30)[0] == 6 and planned == [1, 2, 6]
    assert most_unchecked_layers(lambda n: plan(n, bump=5), 32, 30)[0] == 5
    assert most_unchecked_layers(plan, 4, 30)[0] == 4  # capped at the model's layers
    assert most_unchecked_layers(plan, 32, 12) == (0, None)


def test_a_smaller_ring_is_rejected_untraced_by_its_estimate_from_a_larger_one():
    """By hand: a ring of 8 planned 30 GiB of which 16 scale with the tokens, and 64 GiB offloaded to the host of which
    4 are DeepSpeed's states; a ring of 4 holds twice the tokens a rank: 46 GiB on the card (within 1.15 x a 50 GiB
    budget: traced), 124 GiB of host a process, 992 a machine of 8 (over 1.05 x 512: rejected without a trace); a ring
    of 2: 78 GiB, rejected by its peak. The parts are read off a plan as the search does."""
    from trl_longrm.memory_plan.search import _estimate, _scaling_parts

    plan = types.SimpleNamespace(peak=30 * GIB, activations=12 * GIB, temporaries=4 * GIB, host_memory=64 * GIB,
                                 host_terms={"offloaded optimizer states": 4 * GIB})  # fmt: skip
    reference = (8, _scaling_parts(plan))
    roomy = Cluster.parse("8xh100-80gb", host_memory_gib=2048)
    assert _estimate(reference, 4, roomy, 50 * GIB) is None
    peak, host, reason = _estimate(reference, 4, Cluster.parse("8xh100-80gb", host_memory_gib=512), 50 * GIB)
    assert (peak, host) == (46 * GIB, 8 * 124 * GIB) and reason == "estimated host memory 992 GiB a machine"
    peak, _, reason = _estimate(reference, 2, roomy, 50 * GIB)
    assert peak == 78 * GIB and reason == "estimated 78 GiB"


def test_a_base_recipes_global_batch_is_the_rows_per_step_searched():
    """By hand: a recipe of 2 groups a micro-batch x 4 accumulated on 8 GPUs in rings of 2 (4 replicas) takes 32 groups a
    step; --rows_per_step wins; a recipe without batch keys leaves one a replica; a ring that does not divide is a
    message naming it."""
    from trl_longrm.memory_plan.command import rows_per_step_of

    recipe = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "sequence_parallel_size": 2}
    rows, note = rows_per_step_of(None, recipe, 8)
    assert rows == 32 and "per_device_train_batch_size 2 x gradient_accumulation_steps 4 x 4" in note
    assert rows_per_step_of(None, {"gradient_accumulation_steps": 3}, 8)[0] == 24
    assert rows_per_step_of(6, recipe, 8) == (6, "")
    assert rows_per_step_of(None, {"dataset_name": "x"}, 8) == (None, "")
    with pytest.raises(SystemExit, match="sequence_parallel_size 3 does not divide the 8 GPUs"):
        rows_per_step_of(None, {"per_device_train_batch_size": 1, "sequence_parallel_size": 3}, 8)
    with pytest.raises(SystemExit, match="--rows_per_step 0: at least 1"):
        rows_per_step_of(0, None, 8)
