"""The one exception raised for malformed data, carrying where the problem is (source, row, key)."""

from __future__ import annotations


class DataFormatError(ValueError):
    """A data source, row or value that cannot be used, with the source, row index and key in its message.

    The location is also kept on the exception (`source`, `index`, `key`) so callers can act on it.

    Example:
    ```python
    >>> err = DataFormatError("must be a non-empty list", source="train.jsonl", index=3, key="rejects")
    >>> str(err)
    "train.jsonl, row 3, key 'rejects': must be a non-empty list"
    ```
    """

    def __init__(self, message: str, *, source: str | None = None, index: int | None = None, key: str | None = None):
        self.reason = message
        self.source = source
        self.index = index
        self.key = key
        where = [part for part in (source, None if index is None else f"row {index}") if part is not None]
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)

    def __reduce__(self):
        # Keyword-only fields do not survive the default exception pickling, which `datasets.map(num_proc=...)`
        # relies on to send a worker's error back to the main process.
        return (_rebuild, (self.reason, self.source, self.index, self.key))


def _rebuild(message, source, index, key):
    return DataFormatError(message, source=source, index=index, key=key)
