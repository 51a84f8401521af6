"""Preference groups from a streaming `datasets.IterableDataset`: normalised and tokenised as they are read.

A stream cannot be counted, truncated or binned before training, so each row goes through the same normalisation and
tokenisation as a map-style dataset's when the data loader reads it, rows that do not fit are filtered out there, and
every dropped or truncated row is logged, once, with the running counts of its stream ([`StreamTally`]).
"""

from __future__ import annotations

import logging
from typing import Any

from datasets import IterableDataset
from transformers import PreTrainedTokenizerBase

from .errors import DataFormatError
from .records import normalize_preference_record
from .sources import resolve_supported_preference_layout
from .stock_columns import stock_row
from .tokenization import DROP_REASONS, DROPPED, TRUNCATED, _check_policy, _tokenize_preference


logger = logging.getLogger(__name__)
_KEEP = "__keep"


class StreamTally:
    """Running counts of the rows of one stream: read, truncated, and dropped per reason.

    Example:
    ```python
    >>> tally = StreamTally("train")
    >>> tally.count("truncated", index=3)
    >>> tally.num_read, tally.num_truncated
    (1, 1)
    ```
    """

    def __init__(self, source: str):
        self.source = source
        self.num_read = 0
        self.num_truncated = 0
        self.dropped_by_reason: dict[str, int] = {}
        self._seen: set[int] = set()

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped_by_reason.values())

    def count(self, status: str, index: int) -> None:
        """Count one row's tokenisation status; a dropped or truncated row is logged with the counts so far. A row
        read again (the next epoch, or another pass over the stream) is counted and logged once."""
        if index in self._seen:
            return
        self._seen.add(index)
        self.num_read += 1
        if status.startswith(DROPPED):
            reason = DROP_REASONS[status]
            self.dropped_by_reason[reason] = self.dropped_by_reason.get(reason, 0) + 1
            what, level = f"dropped ({reason})", logging.WARNING
        elif status == TRUNCATED:
            self.num_truncated += 1
            what, level = "truncated (middle of the prompt's longest message cut)", logging.INFO
        else:
            return
        logger.log(
            level,
            "%s: streamed row %d %s; so far %d rows read, %d dropped, %d truncated.",
            self.source,
            index,
            what,
            self.num_read,
            self.num_dropped,
            self.num_truncated,
        )


def stream_preference_dataset(
    dataset: IterableDataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    truncation: str = "drop",
    source_name: str | None = None,
    prompt_key: str | None = None,
    chosen_key: str | None = None,
    rejected_key: str | None = None,
    data_format: str = "auto",
    chat_template_kwargs: dict[str, Any] | None = None,
    stock_columns: str | None = None,
    whole_rendering: bool = False,
    num_rejected: int | None = None,
) -> tuple[IterableDataset, StreamTally]:
    """Tokenised preference groups (`prompt_ids`, `chosen_completion_ids`, `rejected_completion_ids`[, `margin`]) of
    a stream, computed lazily as in [`tokenize_preference_dataset`] (`whole_rendering` too), and the [`StreamTally`]
    that counts its rows. `num_rejected` keeps the first rejected responses of each row (`normalize_preference_record`).
    With `stock_columns` ('reward' or 'cpo'), a group with one rejected response comes in that stock trainer's
    columns instead (see `trl_longrm.data.stock_columns`; a stream has no schema, so each row gets its own).

    The layout is resolved from the first row (read once here), so a column we cannot honour is refused before
    training; a malformed row fails when it is read, naming the stream and the row.

    Example:
    ```python
    >>> stream = load_dataset("json", data_files="prefs.jsonl", split="train", streaming=True)
    >>> groups, tally = stream_preference_dataset(stream, tokenizer, max_length=4096, truncation="truncate_prompt")
    ```
    """
    _check_policy(max_length, truncation)
    source = source_name or "<stream>"
    try:
        first = next(iter(dataset))
    except StopIteration:
        raise DataFormatError("the data stream has no rows", source=source) from None
    columns = list(first.keys())
    layout = resolve_supported_preference_layout(columns, data_format, prompt_key, chosen_key, rejected_key, source)
    tally = StreamTally(source)

    def tokenize(row, index):
        record = normalize_preference_record(row, index=index, source=source, layout=layout, num_rejected=num_rejected)
        out, status = _tokenize_preference(
            record, tokenizer, max_length, truncation, index, source, chat_template_kwargs,
            whole_rendering=whole_rendering,
        )  # fmt: skip
        tally.count(status, index)
        if out is None:
            return {"prompt_ids": [], "chosen_completion_ids": [], "rejected_completion_ids": [], _KEEP: False}
        if stock_columns is not None and len(out["rejected_completion_ids"]) == 1:
            out = stock_row(out, stock_columns)
        return {**out, _KEEP: True}

    mapped = dataset.map(tokenize, with_indices=True, remove_columns=columns)
    return mapped.filter(lambda row: row[_KEEP]).remove_columns(_KEEP), tally
