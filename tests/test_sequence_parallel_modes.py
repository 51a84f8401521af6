"""Ulysses (all-to-all over heads) of 2 and 4 ranks and the hybrid of 2 Ulysses pairs x a ring of 2, for the three
LongRM trainers: a few SGD steps on gloo ranks end with the weights of one process trained on the same micro-batches
(fp32, 1e-5), with shared prefixes crossing the ranks, one and three rejected responses per prompt, the GRM's NLL
term on, and a LoRA DisRM. The tiny models have 4 query / 2 key-value heads: Ulysses of 4 replicates the key/value heads."""

import pytest
import sp_trainer_worker as worker
import torch
from test_sequence_parallel_trainers import PRELOAD, assert_state_close, assert_user_figures_match

from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks
from trl_longrm.testing_utils import build_chat_tokenizer


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tokenizer, out, states = build_chat_tokenizer(), tmp_path_factory.mktemp("reference"), {}
    for kind, num_rejected in worker.MODE_RUNS:
        trainer = worker.mode_trainer(kind, out / f"{kind}{num_rejected}", tokenizer, num_rejected,
                                      sequence_parallel_size=1)  # fmt: skip
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        states[kind, num_rejected] = {**worker.final_state(trainer), "initial": initial}
    return states


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,modes", [(2, [("ulysses", None)]), (4, [("ulysses", None), ("hybrid", 2)])], ids=["ulysses2", "ulysses4+hybrid2x2"]
)
def test_modes_train_like_one_process(tmp_path, references, world_size, modes):
    tasks = [f"mode:{mode}" + (f":{u}" if u else "") for mode, u in modes]
    run_on_gloo_ranks(worker.gloo_worker, world_size, str(tmp_path), tasks, timeout=1200, preload=PRELOAD)
    for mode, ulysses_size in modes:
        for kind, num_rejected in worker.MODE_RUNS:
            what = f"{mode}{ulysses_size or ''} x{world_size} {kind} k={num_rejected}"
            got = torch.load(tmp_path / f"mode_{mode}{ulysses_size or ''}_{kind}{num_rejected}_world{world_size}.pt",
                             weights_only=False)  # fmt: skip
            want = references[kind, num_rejected]
            assert got["global_step"] == want["global_step"] == worker.TRAIN_STEPS, what
            assert_state_close(got["params"], want["params"], what)
            moved = [n for n, p in want["params"].items() if (p - want["initial"][n]).abs().max() > 1e-4]
            if kind.endswith("+lora"):  # the adapter trains, the base stays
                assert moved and all("lora_" in n or "score" in n for n in moved), (what, moved)
            else:
                assert len(moved) > len(want["params"]) // 2, what
            assert [log["loss"] for log in got["logs"]] == pytest.approx([log["loss"] for log in want["logs"]], abs=1e-5), what
            assert_user_figures_match(got, want, what, data_parallel_size=1)
