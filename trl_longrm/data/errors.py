"""The exceptions of a user's mistakes, and how the command line reports them.

`DataFormatError` is raised for malformed data and carries where the problem is (source, row or line, key);
`RunConfigError` for a mistake in a run's settings (a flag, a model that cannot be used as asked, an output folder of
another run). `report_user_error` prints either once, as one line without a traceback.
"""

from __future__ import annotations

import os
import sys


# What every command prints before a user's mistake (`trl_longrm.cli.ERROR_MARK`, which `run_launch` looks for in a
# launch's output, spells it out: importing this package would slow down `trl-longrm --help`).
ERROR_PREFIX = "trl-longrm: error:"


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

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        index: int | None = None,
        key: str | None = None,
        line: int | None = None,
    ):
        self.reason = message
        self.source = source
        self.index = index
        self.key = key
        self.line = line
        # A file's 1-based line is what a user can open; the 0-based row index is what code has.
        position = f"line {line}" if line is not None else (None if index is None else f"row {index}")
        where = [part for part in (source, position) if part is not None]
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)

    def __reduce__(self):
        # Keyword-only fields do not survive the default exception pickling, which `datasets.map(num_proc=...)`
        # relies on to send a worker's error back to the main process.
        return (_rebuild, (self.reason, self.source, self.index, self.key, self.line))

    def at_line(self, line: int) -> DataFormatError:
        """The same error, located at `line` (1-based) of its source file."""
        return DataFormatError(self.reason, source=self.source, index=self.index, key=self.key, line=line)


def _rebuild(message, source, index, key, line=None):
    return DataFormatError(message, source=source, index=index, key=key, line=line)


class RunConfigError(ValueError):
    """A mistake in a run's configuration or data: the command prints it once, as one message, without a traceback."""


# What the commands report as the user's mistake rather than as a failure of the program.
USER_ERRORS = (DataFormatError, RunConfigError)


def report_user_error(error: BaseException | str) -> int:
    """Print `error` (an exception or a message) as the user's mistake, by the main process only where a launch
    started several, and return the exit code of a command that stops on it, 1."""
    # Before or without accelerate: the launcher's global rank, 0 for a single process.
    if os.environ.get("RANK", "0") == "0":
        print(f"{ERROR_PREFIX} {error}", file=sys.stderr, flush=True)
    return 1
