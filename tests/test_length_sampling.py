"""`train_sampling_strategy="group_by_length"` / `"batch_rebalance"` with the preference trainers.

transformers' Trainer builds these samplers from the dataset it trains on (after `_remove_unused_columns`): the
`length_column_name` column when there is one, else `len(input_ids)` of each row, which preference rows lack. Our
prepared datasets carry the tokens each row places in a batch (a group's sequences as the collator lays them out, a
pack's tokens), or the user's own column of that name, carried to each group and summed per pack.
"""

from __future__ import annotations

import re

import pytest
from datasets import Dataset
from trainer_helpers import cpu_args
from transformers.trainer_pt_utils import BatchRebalanceSampler, LengthGroupedSampler
from trl.experimental.cpo import CPOConfig, CPOTrainer

from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer, SimPOGRMConfig, SimPOGRMTrainer
from trl_longrm.testing_utils import build_tiny_model


SAMPLERS = {"group_by_length": LengthGroupedSampler, "batch_rebalance": BatchRebalanceSampler}


def rows(num_rejected=2, user_lengths=None, long_last=False):
    """Preference rows of varied lengths; with `user_lengths`, a `length` column of the user's; with `long_last`, the
    last row's prompt is over 200 tokens long."""
    data = []
    for i in range(8):
        rejected = ["no idea", "the city " * (1 + i % 3)][:num_rejected]
        repeats = 60 if long_last and i == 7 else 1 + 2 * i
        row = {
            "prompt": [{"role": "user", "content": f"question {i} " + "about the river " * repeats}],
            "chosen": f"the answer is {i} " + "yes " * (i % 4),
            "rejected": rejected if num_rejected > 1 else rejected[0],
        }
        if user_lengths is not None:
            row["length"] = user_lengths[i]
        data.append(row)
    return Dataset.from_list(data)


def trainer_for(kind, tokenizer, tmp_path, data, **overrides):
    args = cpu_args(tmp_path, **{"max_length": 256, "max_steps": 2, "per_device_train_batch_size": 2, **overrides})
    if kind == "grm":
        model = build_tiny_model("qwen3", "causal-lm", tokenizer, seed=1)
        return SimPOGRMTrainer(
            model=model, args=SimPOGRMConfig(**args), train_dataset=data, eval_dataset=data, processing_class=tokenizer
        )
    model = build_tiny_model("qwen3", "seq-cls", tokenizer, seed=1)
    return SimPODisRMTrainer(
        model=model, args=SimPODisRMConfig(**args), train_dataset=data, eval_dataset=data, processing_class=tokenizer
    )


def sampler_of(trainer):
    """The train sampler as `Trainer.get_train_dataloader` builds it: on the dataset after unused columns go."""
    return trainer._get_train_sampler(trainer._remove_unused_columns(trainer.train_dataset, description="training"))


def tokens_placed(trainer, dataset):
    """Independent of the lengths column: the tokens the collator lays out for each dataset row on its own."""
    rows = dataset.remove_columns(trainer.args.length_column_name)
    return [trainer.data_collator([row])["input_ids"].numel() for row in rows]


@pytest.mark.parametrize("strategy", ["group_by_length", "batch_rebalance"])
@pytest.mark.parametrize("kind", ["grm", "disrm"])
@pytest.mark.parametrize(
    "layout",
    [
        dict(),  # shared prefixes (the default), groups of k = 2 rejected responses in our columns
        dict(shared_prefix=False),
        dict(num_rejected=1),  # one rejected response: the stock trainer's columns
        dict(max_tokens_per_row=160),  # packed rows
    ],
    ids=["shared", "unshared", "stock_columns", "packed"],
)
def test_length_samplers_see_the_tokens_each_row_places(tmp_path, tokenizer, kind, strategy, layout):
    layout = dict(layout)
    data = rows(num_rejected=layout.pop("num_rejected", 2))
    trainer = trainer_for(kind, tokenizer, tmp_path, data, train_sampling_strategy=strategy, **layout)
    sampler = sampler_of(trainer)
    assert isinstance(sampler, SAMPLERS[strategy])
    assert list(sampler.lengths) == tokens_placed(trainer, trainer.train_dataset)
    if "max_tokens_per_row" in layout:
        assert len(trainer.train_dataset) < len(data)  # packs of several groups, each one sampler item
    else:
        assert len(set(sampler.lengths)) > 4  # varied lengths, so the test would see them mixed up
    if strategy == "group_by_length":  # transformers builds the eval sampler with the lengths too
        eval_sampler = trainer._get_eval_sampler(trainer._remove_unused_columns(trainer.eval_dataset, "evaluation"))
        assert list(eval_sampler.lengths) == tokens_placed(trainer, trainer.eval_dataset)
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.state.log_history[-1]["train_loss"] > 0


@pytest.mark.parametrize("kind", ["grm", "disrm"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("column", ["length", "cost"])
def test_user_length_column_read_by_the_sampler(tmp_path, tokenizer, kind, packed, column):
    """A user column named `length_column_name` is what the sampler reads, as stock reads it: each group keeps its
    row's value (rows dropped as too long leave theirs out), and a pack gets the sum of its groups' values."""
    user = [100 + 7 * i for i in range(8)]
    data = rows(user_lengths=user, long_last=True)
    if column != "length":
        data = data.rename_column("length", column)
    overrides = dict(max_tokens_per_row=200) if packed else {}
    trainer = trainer_for(
        kind,
        tokenizer,
        tmp_path,
        data,
        train_sampling_strategy="group_by_length",
        length_column_name=column,
        max_length=150,  # row 7 is longer and dropped: the values of the rows kept must stay aligned
        truncation="drop",
        **overrides,
    )
    lengths = list(sampler_of(trainer).lengths)
    dataset = trainer.train_dataset

    def row_of(chosen_ids) -> int:  # which source row a group is: its chosen answer names it
        return int(re.search(r"the answer is (\d)", tokenizer.decode(chosen_ids)).group(1))

    if packed:
        groups = [[row_of(ids) for ids in pack] for pack in dataset["chosen_completion_ids"]]
        assert len(groups) < 7 and sorted(sum(groups, [])) == list(range(7))
        assert lengths == [sum(user[i] for i in group) for group in groups]
    else:
        column = "chosen_completion_ids" if "chosen_completion_ids" in dataset.column_names else "chosen_ids"
        kept = [row_of(ids) for ids in dataset[column]]
        assert kept == list(range(7))
        assert lengths == [user[i] for i in kept]
    trainer.train()


def test_user_length_column_as_stock_cpo(tmp_path, tokenizer):
    """Stock CPOTrainer's sampler reads a user `length` column; SimPOGRMTrainer's reads the same values."""
    data = rows(num_rejected=1, user_lengths=[50 + 3 * i for i in range(8)])
    args = cpu_args(tmp_path, max_length=256, per_device_train_batch_size=2, train_sampling_strategy="group_by_length")
    model = build_tiny_model("qwen3", "causal-lm", tokenizer, seed=1)
    stock = CPOTrainer(model=model, args=CPOConfig(**args), train_dataset=data, processing_class=tokenizer)
    ours = trainer_for("grm", tokenizer, tmp_path, data, train_sampling_strategy="group_by_length")
    assert list(sampler_of(ours).lengths) == list(sampler_of(stock).lengths) == data["length"]


@pytest.mark.parametrize("strategy", ["group_by_length", "batch_rebalance"])
def test_packed_sft_rows_sampled_by_their_tokens_as_stock(tmp_path, tokenizer, strategy):
    """LongSFTTrainer's packed row holds its sequences one list each, so `len(input_ids)` would be their count: the
    samplers read the row's tokens, as they read the length of stock SFTTrainer's flat packed rows."""
    from trl import SFTConfig, SFTTrainer

    from trl_longrm import LongSFTConfig, LongSFTTrainer

    data = Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": "question " * (i + 1)}, {"role": "assistant", "content": "yes"}]}
            for i in range(8)
        ]
    )
    args = cpu_args(
        tmp_path,
        max_length=40,
        max_steps=1,
        per_device_train_batch_size=2,
        packing=True,
        train_sampling_strategy=strategy,
    )
    model = build_tiny_model("qwen3", "causal-lm", tokenizer, seed=1)
    stock = SFTTrainer(model=model, args=SFTConfig(**args), train_dataset=data, processing_class=tokenizer)
    ours = LongSFTTrainer(model=model, args=LongSFTConfig(**args), train_dataset=data, processing_class=tokenizer)
    lengths = list(sampler_of(ours).lengths)
    assert lengths == [sum(len(ids) for ids in pack) for pack in ours.train_dataset["input_ids"]]
    assert sorted(lengths) == sorted(sampler_of(stock).lengths)
    ours.train()
