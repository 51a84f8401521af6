"""Reading a data step's input and writing its output, a record at a time, so that a step resumes where it stopped.

Input: a JSON Lines file (read line by line: a 128K-token record is never held with all the others), or anything
`trl_longrm.data.read_source` reads (a `save_to_disk` folder, a `.parquet` / `.json` file, a Hub dataset). Every
record is located in messages by its file and line (JSON Lines) or row.

Output: JSON Lines, one record per line, appended and flushed as each record is finished. A record is known by its
`id` (its own `id` column; else its position in the input). Restarted with the same command, a step reads the ids its
output already holds (a last line cut short by a crash is removed) and does only the others; the settings it was
started with are kept beside the output (`<output>.run.json`) and a restart with other ones is refused, naming them,
while the output holds rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trl_longrm.data.errors import DataFormatError, RunConfigError


RUN_SUFFIX = ".run.json"
DROPPED_SUFFIX = ".dropped.jsonl"
SUMMARY_SUFFIX = ".summary.json"


@dataclass(frozen=True)
class Location:
    """Where a record comes from: its source, and its 1-based line (JSON Lines) or 0-based row."""

    source: str
    line: int | None = None
    row: int | None = None

    def error(self, message: str, key: str | None = None) -> DataFormatError:
        """A `DataFormatError` naming this record (and `key`)."""
        return DataFormatError(message, source=self.source, line=self.line, index=self.row, key=key)

    def __str__(self) -> str:
        return f"{self.source}, line {self.line}" if self.line is not None else f"{self.source}, row {self.row}"


class RecordSource:
    """The records of a step's input, read lazily each time it is iterated: `(location, record)` pairs.

    Example:
    ```python
    >>> source = RecordSource("short.jsonl", required=("question", "answer"))
    >>> source.check()  # every record has the keys, before any model loads
    >>> for where, record in source: ...
    ```
    """

    def __init__(self, path: str | os.PathLike, required: Iterable[str] = (), split: str | None = None):
        self.path = os.fspath(path)
        self.required = tuple(required)
        self.split = split
        if not Path(self.path).expanduser().exists() and self.path.endswith(".jsonl"):
            from trl_longrm.data.sources import missing_path_message

            raise DataFormatError(missing_path_message(self.path), source=self.path)

    def __iter__(self) -> Iterator[tuple[Location, dict]]:
        if self.path.endswith(".jsonl"):
            yield from self._jsonl()
            return
        from trl_longrm.data.sources import read_source

        rows, name = read_source(self.path, split=self.split)
        for index, row in enumerate(rows):
            yield Location(name, row=index), dict(row)

    def _jsonl(self) -> Iterator[tuple[Location, dict]]:
        from trl_longrm.evaluation.benchmark import jsonl_lines

        for number, line in jsonl_lines(self.path):
            where = Location(self.path, line=number)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise where.error(f"not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise where.error(f"a record must be a JSON object, got {type(record).__name__}")
            yield where, record

    def check(self) -> int:
        """Read every record once and check the required keys; returns the number of records. Raises a
        `DataFormatError` naming the first bad record's file, line (or row) and key."""
        count = 0
        for where, record in self:
            missing = [key for key in self.required if record.get(key) is None]
            if missing:
                raise where.error(f"missing key; the record has keys {sorted(record)}", key=missing[0])
            count += 1
        if count == 0:
            raise DataFormatError("no records", source=self.path)
        return count


def record_id(where: Location, record: dict) -> str:
    """A record's id: its `id` (as text), else its position in the input."""
    value = record.get("id")
    if value is not None:
        return str(value)
    return str(where.line - 1 if where.line is not None else where.row)


class ResumableWriter:
    """Appends records to a JSON Lines output as they are finished; knows the ids already there.

    `identity` is the step's settings that change its output: kept beside the output, and a restart with other ones is
    a `RunConfigError` naming each, while the output holds rows. A record that gives no row (`drop`) is listed with
    its reason in `<output>.dropped.jsonl`, so that a restart does not try it again either.
    """

    def __init__(self, path: str | os.PathLike, identity: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_file = self.path.with_name(self.path.name + RUN_SUFFIX)
        self.dropped_file = self.path.with_name(self.path.name + DROPPED_SUFFIX)
        self.done = self._read_done(self.path)
        self.done |= self._read_done(self.dropped_file)
        self._check_identity(identity)
        tmp = self.run_file.with_name(self.run_file.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(identity, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.run_file)
        self._handle = self.path.open("a", encoding="utf-8")
        self._dropped = None

    @staticmethod
    def _read_done(path: Path) -> set[str]:
        if not path.exists():
            return set()
        data = path.read_bytes()
        complete, torn = data.rsplit(b"\n", 1) if b"\n" in data else (b"", data)
        if torn.strip():  # a line being written when the step stopped: done again
            with path.open("r+b") as handle:
                handle.truncate(len(data) - len(torn))
        done = set()
        for number, line in enumerate(complete.split(b"\n"), start=1):
            if not line.strip():
                continue
            try:
                done.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError) as error:
                raise DataFormatError(
                    f"not a record this step wrote ({error!r}); move the file away to start afresh",
                    source=str(path),
                    line=number,
                ) from None
        return done

    def _check_identity(self, identity: dict) -> None:
        if not self.done or not self.run_file.exists():
            return
        try:
            earlier = json.loads(self.run_file.read_text(encoding="utf-8"))
        except ValueError as error:
            raise RunConfigError(
                f"{self.run_file}: unreadable ({error}); move {self.path} away to start afresh."
            ) from None
        identity = json.loads(json.dumps(identity))  # as it reads back
        changed = [key for key in dict.fromkeys([*identity, *earlier]) if identity.get(key) != earlier.get(key)]
        if changed:
            details = "; ".join(f"{key}: {earlier.get(key)!r} -> {identity.get(key)!r}" for key in changed)
            raise RunConfigError(
                f"{self.path} holds {len(self.done)} records made with other settings ({details}); run the command "
                "that made them to resume, or move the file away to start afresh."
            )

    def write(self, record: dict) -> None:
        """Append one finished record (it must have an `id`), flushed to the file at once."""
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._handle.flush()
        self.done.add(str(record["id"]))

    def drop(self, rid: str, reason: str) -> None:
        """Record that the record `rid` gives no row, and why (`<output>.dropped.jsonl`)."""
        if self._dropped is None:
            self._dropped = self.dropped_file.open("a", encoding="utf-8")
        self._dropped.write(json.dumps({"id": rid, "reason": reason}, ensure_ascii=False) + "\n")
        self._dropped.flush()
        self.done.add(str(rid))

    def close(self) -> None:
        self._handle.close()
        if self._dropped is not None:
            self._dropped.close()

    def __enter__(self) -> ResumableWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write `records` to `path` as JSON Lines, whole or not at all (a temporary file renamed); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count
