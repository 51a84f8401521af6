"""The stock TRL trainers' processed columns for tokenised preference groups, and the way back.

A tokenised group (`tokenize_preference_record`) keeps its prompt once: `prompt_ids`, `chosen_completion_ids` and
`rejected_completion_ids` (k lists). A TRL user who reads `trainer.train_dataset` expects the stock trainer's columns:
RewardTrainer's whole sequences `chosen_ids` / `rejected_ids`, CPOTrainer's `prompt_input_ids` plus the whole
sequences `chosen_input_ids` / `rejected_input_ids`. Those hold one rejected response, so a dataset whose groups all
have one is given the stock columns (with the stock trainers' cost: the prompt stored once per sequence), and groups
with several rejected responses (LongRM's `rejects`, not a stock format) keep ours. The collator and the packer read
either through [`group_of`].

Example:
```python
>>> group = {"prompt_ids": [5, 6], "chosen_completion_ids": [7, 2], "rejected_completion_ids": [[8, 2]]}
>>> stock_row(group, "reward")
{'chosen_ids': [5, 6, 7, 2], 'rejected_ids': [5, 6, 8, 2]}
>>> group_of(stock_row(group, "cpo")) == group
True
```
"""

from __future__ import annotations

from typing import Any

import pyarrow.compute as pc
from datasets import Dataset


GROUP_COLUMNS = ("prompt_ids", "chosen_completion_ids", "rejected_completion_ids")
REWARD_COLUMNS = ("chosen_ids", "rejected_ids")  # RewardTrainer: prompt + response, per sequence
CPO_COLUMNS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")  # CPOTrainer: and the prompt alone
STOCK_COLUMNS = {"reward": REWARD_COLUMNS, "cpo": CPO_COLUMNS}


def shared_token_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of `a` and `b`, leaving at least one token of each to itself."""
    limit = min(len(a), len(b)) - 1
    shared = 0
    while shared < limit and a[shared] == b[shared]:
        shared += 1
    return shared


def stock_row(group: dict[str, Any], style: str) -> dict[str, Any]:
    """A group with one rejected response in the stock columns of `style` ('reward' or 'cpo'); `margin` is kept."""
    prompt, chosen = list(group["prompt_ids"]), list(group["chosen_completion_ids"])
    (rejected,) = group["rejected_completion_ids"]
    if style == "reward":
        row = {"chosen_ids": prompt + chosen, "rejected_ids": prompt + list(rejected)}
    elif style == "cpo":
        row = {
            "prompt_input_ids": prompt,
            "chosen_input_ids": prompt + chosen,
            "rejected_input_ids": prompt + rejected,
        }
    else:
        raise ValueError(f"Unknown stock column style {style!r}; expected one of {list(STOCK_COLUMNS)}.")
    if "margin" in group:
        row["margin"] = group["margin"]
    return row


def is_group_row(row: dict[str, Any]) -> bool:
    """Whether `row` is one of our tokenised groups (or packs), in our columns or in a stock trainer's."""
    return any(all(c in row for c in columns) for columns in (GROUP_COLUMNS, REWARD_COLUMNS, CPO_COLUMNS))


def group_of(row: dict[str, Any]) -> dict[str, Any]:
    """The group of a row in any of the three layouts (ours is returned as is).

    RewardTrainer's layout has no prompt boundary: the prompt is taken as the sequences' longest common prefix, which
    leaves each sequence (and so its score at the last token, and the shared-prefix layout) unchanged.
    """
    if "prompt_ids" in row:
        return row
    if all(c in row for c in CPO_COLUMNS):
        prompt = list(row["prompt_input_ids"])
        chosen, rejected = list(row["chosen_input_ids"]), list(row["rejected_input_ids"])
        shared = len(prompt)
    elif all(c in row for c in REWARD_COLUMNS):
        chosen, rejected = list(row["chosen_ids"]), list(row["rejected_ids"])
        shared = shared_token_prefix(chosen, rejected)
    else:
        raise ValueError(
            f"A preference row needs the columns {list(GROUP_COLUMNS)}, {list(REWARD_COLUMNS)} or {list(CPO_COLUMNS)}; "
            f"got {sorted(row)}."
        )
    group = {
        "prompt_ids": chosen[:shared],
        "chosen_completion_ids": chosen[shared:],
        "rejected_completion_ids": [rejected[shared:]],
    }
    if row.get("margin") is not None:
        group["margin"] = row["margin"]
    return group


def with_stock_columns(dataset: Dataset, style: str | None, num_proc: int | None = None) -> Dataset:
    """`dataset` of tokenised groups in the stock columns of `style` when every group has one rejected response;
    unchanged otherwise (or when `style` is None)."""
    if style is None or not isinstance(dataset, Dataset) or not all(c in dataset.column_names for c in GROUP_COLUMNS):
        return dataset
    if len(dataset) == 0:
        return dataset
    # Arrow's list lengths: no row is read into Python to find k.
    counts = pc.list_value_length(dataset.data.column("rejected_completion_ids"))
    if pc.min(counts).as_py() != 1 or pc.max(counts).as_py() != 1:
        return dataset
    return dataset.map(
        lambda group: stock_row(group, style),
        remove_columns=list(GROUP_COLUMNS),
        num_proc=num_proc,
        desc=f"{'RewardTrainer' if style == 'reward' else 'CPOTrainer'}'s columns",
    )
