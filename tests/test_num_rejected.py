"""`num_rejected` (LongRM's `num_rejects`, the paper's V): training with the first n rejected responses of each row
equals training on rows cut to their first n by hand, in both preference trainers and on every input path."""

import json

import pytest
import torch
from datasets import Dataset, IterableDataset
from trainer_helpers import cpu_args, random_groups, write_longrm_jsonl

from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer, SimPOGRMConfig, SimPOGRMTrainer
from trl_longrm.testing_utils import save_tiny_model


KINDS = {
    "grm": (SimPOGRMTrainer, SimPOGRMConfig, "causal-lm"),
    "disrm": (SimPODisRMTrainer, SimPODisRMConfig, "seq-cls"),
}


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "causal-lm": save_tiny_model(root / "lm", arch="qwen3", task="causal-lm", seed=3),
        "seq-cls": save_tiny_model(root / "cls", arch="llama", task="seq-cls", seed=3),
    }


def _rows(tmp_path, num_rejected=4):
    path = write_longrm_jsonl(tmp_path / "rows.jsonl", 6, num_rejected=num_rejected, seed=11)
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _train(kind, model_path, tmp_path, name, rows, **overrides):
    trainer_cls, config_cls, _ = KINDS[kind]
    settings = dict(per_device_train_batch_size=2, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
                    max_steps=3)  # fmt: skip
    args = config_cls(**cpu_args(tmp_path / name, **{**settings, **overrides}))
    trainer = trainer_cls(model=model_path, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_with_n_rejected_equals_rows_cut_by_hand(tmp_path, model_paths, kind):
    rows = _rows(tmp_path)
    cut = [{**row, "rejects": row["rejects"][:2]} for row in rows]
    model_path = model_paths[KINDS[kind][2]]
    losses, params = _train(kind, model_path, tmp_path, "field", rows, num_rejected=2)
    hand_losses, hand_params = _train(kind, model_path, tmp_path, "hand", cut)
    assert len(losses) == 3 and losses == hand_losses
    assert all(torch.equal(params[name], hand_params[name]) for name in params)
    # All four rejected responses train otherwise: the field changed what was trained.
    all_losses, _ = _train(kind, model_path, tmp_path, "all", rows)
    assert all_losses != losses


def test_every_input_path_keeps_the_first_n(tmp_path, tokenizer):
    """Text rows, pre-tokenised groups and a stream give the trainer the first n rejected responses of each row, in
    their order."""
    from trl_longrm.trainers.common import prepare_preference_dataset

    args = SimPOGRMConfig(**cpu_args(tmp_path, max_length=512, num_rejected=2))
    rows = _rows(tmp_path, num_rejected=3)
    cut = [{**row, "rejects": row["rejects"][:2]} for row in rows]
    ours = prepare_preference_dataset(Dataset.from_list(rows), tokenizer, args, "train")
    hand = prepare_preference_dataset(
        Dataset.from_list(cut), tokenizer, SimPOGRMConfig(**cpu_args(tmp_path, max_length=512)), "train"
    )
    assert ours.to_list() == hand.to_list()
    assert [len(r) for r in ours["rejected_completion_ids"]] == [2] * len(rows)

    groups = random_groups(tokenizer, 5, 4, seed=2)
    prepared = prepare_preference_dataset(groups, tokenizer, args, "train")
    assert prepared["rejected_completion_ids"] == [r[:2] for r in groups["rejected_completion_ids"]]

    stream = IterableDataset.from_generator(lambda: iter(rows))
    streamed = list(prepare_preference_dataset(stream, tokenizer, args, "train"))
    assert [row["rejected_completion_ids"] for row in streamed] == hand["rejected_completion_ids"]


def test_num_rejected_refusals(tmp_path, tokenizer):
    from trl_longrm.packing import pack_groups
    from trl_longrm.trainers.common import prepare_preference_dataset

    with pytest.raises(ValueError, match="`num_rejected` must be"):
        SimPODisRMConfig(**cpu_args(tmp_path, num_rejected=0))
    packed = pack_groups(random_groups(tokenizer, 4, 3, seed=1), 4096)
    args = SimPOGRMConfig(**cpu_args(tmp_path, num_rejected=2))
    with pytest.raises(ValueError, match="packed already \\(a group has 3 rejected"):
        prepare_preference_dataset(packed, tokenizer, args, "train")
    # A pack whose groups have no more than n is one prepared with these settings: kept.
    assert (
        prepare_preference_dataset(packed, tokenizer, SimPOGRMConfig(**cpu_args(tmp_path, num_rejected=3)), "train")
        is packed
    )


def test_cosine_with_min_lr_ends_at_its_floor(tmp_path, model_paths):
    """The recipes' scheduler (LongRM's code: cosine down to 0.1 x lr) as transformers provides it, in our trainer."""
    args = SimPOGRMConfig(**cpu_args(tmp_path, learning_rate=1e-3, lr_scheduler_type="cosine_with_min_lr",
                                     lr_scheduler_kwargs={"min_lr_rate": 0.1}))  # fmt: skip
    trainer = SimPOGRMTrainer(
        model=model_paths["causal-lm"], args=args, train_dataset=Dataset.from_list(_rows(tmp_path))
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    for _ in range(10):
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(1e-4)
