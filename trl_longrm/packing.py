"""Collators and bin packing for tokenised preference groups and SFT examples.

A tokenised preference group (see `trl_longrm.data`) is `prompt_ids`, `chosen_completion_ids`,
`rejected_completion_ids` (k lists) and optionally `margin`. Each group becomes k + 1 sequences
`prompt + completion`, labelled -100 on the prompt. The collators emit either

- a *padding-free* row (`padding_free=True`): every sequence of every group of the micro-batch laid end to end in
  one row `[1, T]`, `position_ids` restarting at 0 for each sequence, no padding computed. Documents stay separate
  because transformers 5 derives document boundaries from `position_ids` when no cache is used, and our ring
  attention reads the same boundaries; or
- a padded batch `[S, L_max]` with an `attention_mask` (`padding_free=False`).

Either way the batch also carries `sequence_lengths [S]`, `group_index [S]` and `response_index [S]` (0 = chosen,
1..k = rejected) so the loss can regroup per-sequence values, `group_row [G]` (the dataset row, i.e. the example or
pack, each group came from: metrics are reduced per row, the unit accelerate gathers), and `score_positions [S]`, the
flat index of each sequence's last token. The first token of each sequence is never a label, so a shifted label never crosses into the
previous sequence of a packed row.

With `shared_prefix=True` (padding-free only) a group is laid out as its prompt once followed by each completion,
the completions' positions continuing from the prompt's length; the row's documents and the log-probs to compute then
travel as explicit metadata (see `PreferenceCollator`), and every per-sequence value equals the unshared layout's.

`pack_groups` bins whole groups (a group's sequences always stay together) into packs of at most
`max_tokens_per_row` tokens, best-fit decreasing; each pack is one dataset row, so with
`per_device_train_batch_size=1` every step trains one row of at most that many tokens.

Example:
```python
>>> from trl_longrm.packing import PreferenceCollator
>>> collator = PreferenceCollator(pad_token_id=0)
>>> batch = collator([{"prompt_ids": [5, 6], "chosen_completion_ids": [7, 2], "rejected_completion_ids": [[8, 2]]}])
>>> batch["input_ids"].tolist(), batch["position_ids"].tolist()
([[5, 6, 7, 2, 5, 6, 8, 2]], [[0, 1, 2, 3, 0, 1, 2, 3]])
```
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset

from trl_longrm.data.stock_columns import group_of


logger = logging.getLogger(__name__)

GROUP_COLUMNS = ("prompt_ids", "chosen_completion_ids", "rejected_completion_ids")


def _is_pack(example: dict[str, Any]) -> bool:
    prompt = example.get("prompt_ids")
    return prompt is not None and len(prompt) > 0 and isinstance(prompt[0], list)


def _groups_of(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Examples may be single groups (in our columns or a stock trainer's, see `trl_longrm.data.stock_columns`) or
    packs of groups (from `pack_groups`); return the groups."""
    groups = []
    for example in examples:
        if _is_pack(example):
            margins = example.get("margin")
            for i in range(len(example["prompt_ids"])):
                group = {key: example[key][i] for key in GROUP_COLUMNS}
                if margins is not None:
                    group["margin"] = margins[i]
                groups.append(group)
        else:
            groups.append(group_of(example))
    return groups


def _group_rows(examples: list[dict[str, Any]]) -> torch.Tensor:
    """For each group of `_groups_of(examples)`, the index of the example (dataset row) it came from."""
    rows = []
    for row, example in enumerate(examples):
        rows += [row] * (len(example["prompt_ids"]) if _is_pack(example) else 1)
    return torch.tensor(rows, dtype=torch.long)


def group_num_tokens(example: dict[str, Any], shared_prefix: bool = False) -> int:
    """Tokens a group occupies once collated: (k + 1) copies of the prompt plus every completion, or the prompt
    once plus every completion in the shared-prefix layout."""
    example = group_of(example)
    completions = [example["chosen_completion_ids"], *example["rejected_completion_ids"]]
    copies = 1 if shared_prefix and len(example["prompt_ids"]) > 0 else len(completions)
    return len(example["prompt_ids"]) * copies + sum(len(c) for c in completions)


def _pad(sequences: list[list[int]], value: int, multiple: int | None) -> torch.Tensor:
    length = max(len(s) for s in sequences)
    if multiple:
        length = -(-length // multiple) * multiple
    out = torch.full((len(sequences), length), value, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate_sequences(
    sequences: list[list[int]],
    labels: list[list[int]],
    pad_token_id: int,
    padding_free: bool,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Lay sequences out as one padding-free row or as a padded batch; see the module docstring."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    if padding_free:
        batch = {
            "input_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.long).unsqueeze(0),
            "labels": torch.tensor([t for s in labels for t in s], dtype=torch.long).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()]).unsqueeze(0),
        }
        score_positions = torch.cumsum(lengths, 0) - 1
    else:
        batch = {
            "input_ids": _pad(sequences, pad_token_id, pad_to_multiple_of),
            "labels": _pad(labels, -100, pad_to_multiple_of),
            "attention_mask": _pad([[1] * len(s) for s in sequences], 0, pad_to_multiple_of),
        }
        score_positions = torch.arange(len(sequences)) * batch["input_ids"].shape[1] + lengths - 1
    batch["sequence_lengths"] = lengths
    batch["score_positions"] = score_positions
    return batch


SHARED_ROW_KEYS = ("segment_lengths", "segment_parents", "logprob_positions", "logprob_targets", "logprob_sequence")
"""Keys that mark a batch in the shared-prefix layout (see `PreferenceCollator`)."""


def is_shared_prefix_batch(batch: dict[str, Any]) -> bool:
    """Whether a collated batch is in the shared-prefix layout: its documents are in `segment_lengths` /
    `segment_parents`, not in its `position_ids`, so it must reach the model with attention metadata."""
    return "segment_parents" in batch


def _shared_row(groups: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One row in the shared-prefix layout; the per-sequence values equal those of the unshared layout."""
    input_ids, position_ids, segment_lengths, segment_parents = [], [], [], []
    positions, targets, owners, score_positions, lengths, group_index, response_index = [], [], [], [], [], [], []

    def add_segment(tokens: list[int], first_position: int, parent: int) -> int:
        start = len(input_ids)
        input_ids.extend(tokens)
        position_ids.extend(range(first_position, first_position + len(tokens)))
        segment_lengths.append(len(tokens))
        segment_parents.append(parent)
        return start

    for g, group in enumerate(groups):
        prompt = list(group["prompt_ids"])
        completions = [list(group["chosen_completion_ids"]), *(list(r) for r in group["rejected_completion_ids"])]
        if len(completions) < 2:
            raise ValueError(f"Preference group {g} of the batch has no rejected completion.")
        shared = len(prompt) > 0
        if shared:
            prefix_segment, prefix_start = len(segment_lengths), add_segment(prompt, 0, -1)
        for r, completion in enumerate(completions):
            s = len(lengths)
            length = len(prompt) + len(completion)
            if not length:
                raise ValueError(f"Preference group {g} of the batch has an empty prompt and an empty completion.")
            # The unshared labels (see `PreferenceCollator`): token i + 1 is predicted at token i; a response's first
            # token is predicted at the prompt's last token, which the shared prefix holds once for all responses.
            # (Where the prompt is shared no `prompt + completion` list is built: at a million tokens, one per
            # response was most of the collator's time.)
            if shared:
                start = add_segment(completion, len(prompt), prefix_segment) if completion else len(input_ids)
                last_prompt_token = prefix_start + len(prompt) - 1
                if completion:
                    positions.append(last_prompt_token)
                    positions.extend(range(start, start + len(completion) - 1))
                targets.extend(completion)
                score_positions.append(start + len(completion) - 1 if completion else last_prompt_token)
            else:
                sequence = prompt + completion
                start = add_segment(sequence, 0, -1)
                positions.extend(range(start, start + length - 1))
                targets.extend(sequence[1:])
                score_positions.append(start + length - 1)
            owners.extend([s] * (len(completion) if shared else length - 1))
            lengths.append(length)
            group_index.append(g)
            response_index.append(r)

    def tensor(values):
        return torch.tensor(values, dtype=torch.long)

    return {
        "input_ids": tensor(input_ids).unsqueeze(0),
        "position_ids": tensor(position_ids).unsqueeze(0),
        "segment_lengths": tensor(segment_lengths),
        "segment_parents": tensor(segment_parents),
        "logprob_positions": tensor(positions),
        "logprob_targets": tensor(targets),
        "logprob_sequence": tensor(owners),
        "sequence_lengths": tensor(lengths),
        "score_positions": tensor(score_positions),
        "group_index": tensor(group_index),
        "response_index": tensor(response_index),
    }


@dataclass
class PreferenceCollator:
    """Collate tokenised preference groups (or packs of them) into one batch; see the module docstring.

    Args:
        pad_token_id: token used to pad (padded mode only).
        padding_free: one row with restarting `position_ids` (default) or a padded batch.
        pad_to_multiple_of: pad the padded batch's length to a multiple of this.
        shared_prefix: lay each group out as its prompt once followed by each completion (padding-free only), the
            completions' `position_ids` continuing from the prompt's length. The row's documents are then given by
            `segment_lengths [N]` and `segment_parents [N]` (the document a completion continues, -1 for none), and
            the log-probs to compute by `logprob_positions [P]` (row index of the predicting token),
            `logprob_targets [P]` and `logprob_sequence [P]` (the sequence each belongs to): a prompt's last token
            predicts the first token of every completion. There are no `labels`. Only the `"longrm_ring"` attention
            given the metadata of `shared_row_metadata` / `shard_packed_row` attends such a row correctly.

    Example (shared prefix):
    ```python
    >>> collator = PreferenceCollator(pad_token_id=0, shared_prefix=True)
    >>> batch = collator([{"prompt_ids": [5, 6], "chosen_completion_ids": [7, 2], "rejected_completion_ids": [[8, 2]]}])
    >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["segment_parents"].tolist()
    ([[5, 6, 7, 2, 8, 2]], [[0, 1, 2, 3, 2, 3]], [-1, 0, 0])
    ```
    """

    pad_token_id: int
    padding_free: bool = True
    pad_to_multiple_of: int | None = None
    shared_prefix: bool = False

    def __post_init__(self):
        if self.shared_prefix and not self.padding_free:
            raise ValueError(
                "PreferenceCollator(shared_prefix=True) lays groups out in one row: it needs padding_free."
            )

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        groups = _groups_of(examples)
        if self.shared_prefix:
            batch = _shared_row(groups)
            if all("margin" in g and g["margin"] is not None for g in groups):
                batch["margin"] = torch.tensor([float(g["margin"]) for g in groups], dtype=torch.float)
            batch["group_row"] = _group_rows(examples)
            return batch
        sequences, labels, group_index, response_index = [], [], [], []
        for g, group in enumerate(groups):
            prompt = list(group["prompt_ids"])
            completions = [group["chosen_completion_ids"], *group["rejected_completion_ids"]]
            if len(completions) < 2:
                raise ValueError(f"Preference group {g} of the batch has no rejected completion.")
            for r, completion in enumerate(completions):
                completion = list(completion)
                sequences.append(prompt + completion)
                # Never train the first token of a sequence: its shifted label would read the previous sequence.
                labels.append([-100] * max(len(prompt), 1) + completion[max(0, 1 - len(prompt)) :])
                group_index.append(g)
                response_index.append(r)
        batch = collate_sequences(sequences, labels, self.pad_token_id, self.padding_free, self.pad_to_multiple_of)
        batch["group_index"] = torch.tensor(group_index, dtype=torch.long)
        batch["response_index"] = torch.tensor(response_index, dtype=torch.long)
        batch["group_row"] = _group_rows(examples)
        if all("margin" in g and g["margin"] is not None for g in groups):
            batch["margin"] = torch.tensor([float(g["margin"]) for g in groups], dtype=torch.float)
        return batch


@dataclass
class SFTCollator:
    """Collate tokenised SFT examples (`input_ids` with `completion_mask`, or with stock SFTTrainer's `labels`: the
    token where trained, -100 elsewhere) or packs of them, padding-free or padded.

    Labels are the input ids where `completion_mask` is 1 (the label is not -100) and -100 elsewhere; the first token
    of each sequence is never a label.
    """

    pad_token_id: int
    padding_free: bool = True
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, labels = [], []
        for example in examples:
            ids, masks = example["input_ids"], example.get("completion_mask")
            given_labels = example.get("labels")
            packed = len(ids) > 0 and isinstance(ids[0], list)
            if given_labels is not None:
                per_sequence = given_labels if packed else [given_labels]
                masks = [[int(label != -100) for label in sequence] for sequence in per_sequence]
                masks = masks if packed else masks[0]
            if not packed:
                ids, masks = [ids], [masks]
            for seq, mask in zip(ids, masks):
                seq = list(seq)
                mask = [1] * len(seq) if mask is None else list(mask)
                sequences.append(seq)
                labels.append([-100] + [t if m else -100 for t, m in zip(seq[1:], mask[1:])])
        return collate_sequences(sequences, labels, self.pad_token_id, self.padding_free, self.pad_to_multiple_of)


def _best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        size = sizes[index]
        best = None
        for b, space in enumerate(free):
            if size <= space and (best is None or space < free[best]):
                best = b
        if best is None:
            bins.append([index])
            free.append(capacity - size)
        else:
            bins[best].append(index)
            free[best] -= size
    return [sorted(b) for b in bins]


def pack_examples(
    dataset: Dataset, sizes: list[int], max_tokens_per_row: int, columns: tuple[str, ...], seq_lengths: bool = False
) -> Dataset:
    """Bin rows of `dataset` (each of `sizes[i]` tokens) into packs of at most `max_tokens_per_row` tokens; with
    `seq_lengths`, each pack also lists its rows' sizes (stock SFTTrainer's column of that name).

    A row larger than the budget gets a pack of its own; how many did is logged.
    """
    oversized = sum(size > max_tokens_per_row for size in sizes)
    if oversized:
        logger.warning(
            "%d of %d rows exceed max_tokens_per_row=%d on their own; each is trained in a row of its own.",
            oversized,
            len(sizes),
            max_tokens_per_row,
        )
    bins = _best_fit_decreasing(sizes, max_tokens_per_row)
    present = [c for c in columns if c in dataset.column_names]
    data = {column: dataset[column] for column in present}
    packs = {column: [[data[column][i] for i in b] for b in bins] for column in present}
    packs["num_tokens"] = [sum(sizes[i] for i in b) for b in bins]
    if seq_lengths:
        packs["seq_lengths"] = [[sizes[i] for i in b] for b in bins]
    logger.info("Packed %d rows into %d rows of at most %d tokens.", len(sizes), len(bins), max_tokens_per_row)
    return Dataset.from_dict(packs)


def pack_groups(
    dataset: Dataset, max_tokens_per_row: int, shared_prefix: bool = False, keep_columns: tuple[str, ...] = ()
) -> Dataset:
    """Bin whole tokenised preference groups into packs of at most `max_tokens_per_row` tokens as they will be
    placed in the row (the prompt once per group with `shared_prefix`); see the module docstring. Each of
    `keep_columns` becomes the list of its groups' values in each pack, as `margin` does."""
    sizes = [group_num_tokens(row, shared_prefix) for row in dataset]
    return pack_examples(dataset, sizes, max_tokens_per_row, (*GROUP_COLUMNS, "margin", *keep_columns))


def pack_sft_examples(dataset: Dataset, max_tokens_per_row: int) -> Dataset:
    """Bin tokenised SFT examples into packs of at most `max_tokens_per_row` tokens. Each pack also has stock
    SFTTrainer's `seq_lengths` column (the token count of each of its examples), as TRL's packed datasets do."""
    sizes = [len(ids) for ids in dataset["input_ids"]]
    return pack_examples(dataset, sizes, max_tokens_per_row, ("input_ids", "completion_mask"), seq_lengths=True)
