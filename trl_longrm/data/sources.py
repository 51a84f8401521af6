"""Loading preference and SFT data from any supported source and normalising it to canonical records.

Sources: a `save_to_disk` folder (a `Dataset`, or a `DatasetDict` with `split`), a `.jsonl`/`.json`/`.parquet` file,
an in-memory `Dataset`/`DatasetDict`, a list of dicts, or a Hugging Face Hub dataset name.
"""

from __future__ import annotations

import codecs
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
from datasets import Dataset, DatasetDict

from .errors import DataFormatError
from .records import (
    normalize_preference_record,
    normalize_sft_record,
    resolve_preference_layout,
    resolve_sft_layout,
)


FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
DataSource = str | os.PathLike | Dataset | DatasetDict | list


def _pick_split(dataset_dict: DatasetDict, split: str | None, source: str) -> tuple[Dataset, str]:
    split = split or ("train" if "train" in dataset_dict else None)
    if split is None or split not in dataset_dict:
        raise DataFormatError(
            f"split {split!r} not found; available splits: {sorted(dataset_dict)} (pass split=)", source=source
        )
    return dataset_dict[split], f"{source} [split={split}]"


def looks_local(text: str) -> bool:
    """Whether a name that does not exist is meant as a local path rather than a Hub id (`name` or `owner/name`):
    it starts with `.`, `/` or `~`, has a data file's extension, has more than one `/`, or its first part is a local
    folder (`data/nope` where `data/` exists)."""
    first = text.split("/", 1)[0]
    return (
        text.startswith((".", "/", "~"))
        or Path(text).suffix.lower() in FILE_BUILDERS
        or text.count("/") > 1
        or ("/" in text and Path(first).is_dir())
    )


def missing_path_message(text: str) -> str:
    """'no such file or folder', with the folder a relative path was resolved against."""
    path = Path(text).expanduser()
    where = "" if path.is_absolute() else f" (resolved against {Path.cwd()})"
    return f"no such file or folder{where}"


def line_of_row(path: str | os.PathLike, index: int) -> int | None:
    """The 1-based line of row `index` (0-based) of a JSON Lines file, whose blank lines hold no row; None past
    its end."""
    row = -1
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                row += 1
                if row == index:
                    return number
    return None


def text_lines(path: str | os.PathLike, source: str | None = None) -> Iterator[tuple[int, str]]:
    """The lines of a text file (JSON Lines) with their 1-based numbers; a line that is not UTF-8 text is a
    [`DataFormatError`] naming the file (`source` if given) and the line, which the codec's own error names neither."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataFormatError(
                    f"not UTF-8 text (byte 0x{raw[error.start]:02x} at byte {error.start + 1} of the line); save the "
                    "file as UTF-8",
                    source=source or os.fspath(path),
                    line=number,
                ) from None
            yield number, text


def check_utf8(path: str | os.PathLike, source: str | None = None, chunk_bytes: int = 1 << 24) -> None:
    """Raise `text_lines`' error (file, line, byte) if `path` is not UTF-8 text. Decoded in large chunks at C speed;
    the file is read line by line only to locate a bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(chunk_bytes):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        for _ in text_lines(path, source=source):
            pass
        raise


def locate_error(error: DataFormatError, path: str | os.PathLike | None) -> DataFormatError:
    """`error` located at its line where its row comes from a `.jsonl` file `path`, else `error` itself."""
    if error.index is None or error.line is not None or path is None or not os.fspath(path).endswith(".jsonl"):
        return error
    if not Path(path).is_file():
        return error
    line = line_of_row(path, error.index)
    return error if line is None else error.at_line(line)


def file_split_problem(path: str | os.PathLike, split: str | None) -> str | None:
    """Why `split` cannot be read from the single data file `path` (a file holds one split, `train`), else None."""
    if split in (None, "train"):
        return None
    return (
        f"split {split!r} cannot apply: a single {Path(path).suffix} file holds one split, 'train' (for other "
        "splits give a folder saved with `DatasetDict.save_to_disk`)"
    )


def empty_file_reason(path: Path) -> str | None:
    if path.stat().st_size == 0:
        return "the file is empty"
    with open(path, "rb") as handle:
        if not any(line.strip() for line in handle):
            return "the file holds only blank lines"
    return None


def _read_only(path: Path) -> bool:
    # Root passes `os.access` everywhere, so the permission bits are checked too: a folder marked read-only (like a
    # shared data folder) must not receive `datasets` cache files.
    return not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222


def load_raw_dataset(
    source: DataSource, split: str | None = None, source_name: str | None = None, keep_in_memory: bool | None = None
) -> Dataset | list:
    """Read a source as it is stored (no normalisation): a `Dataset`, or the list itself for a list of dicts.

    A `DatasetDict` (on disk or in memory) needs `split`, which defaults to `"train"` when there is one. A string that
    is neither an existing path nor path-like (`./x`, `/x`, `x.jsonl`) is taken as a Hub dataset name. Unreadable
    sources raise [`DataFormatError`] naming the source (`source_name` if given).

    `keep_in_memory=True` reads the data into memory, so that later `map`s keep their results there instead of writing
    `datasets` cache files; None does this for read-only `save_to_disk` folders only (`map` writes its cache next to
    such a dataset's files).

    Example:
    ```python
    >>> load_raw_dataset("path/to/longrm_simpo_sample", split="test").column_names[:2]
    ['index', 'extra_generate_kwargs']
    ```
    """
    return read_source(source, split, source_name, keep_in_memory)[0]


def read_source(
    source: DataSource, split: str | None = None, source_name: str | None = None, keep_in_memory: bool | None = None
) -> tuple[Dataset | list, str]:
    """[`load_raw_dataset`] plus the name of the source used in messages (e.g. `"data.jsonl"`, `"dir [split=eval]"`).

    Example:
    ```python
    >>> rows, name = read_source([{"prompt": "p", "chosen": "a", "rejected": "b"}])
    >>> name
    '<list of 1 rows>'
    ```
    """
    if isinstance(source, list):
        return source, source_name or f"<list of {len(source)} rows>"
    if isinstance(source, Dataset):
        return source, source_name or f"<in-memory Dataset{'' if split is None else f' [split={split}]'}>"
    if isinstance(source, DatasetDict):
        return _pick_split(source, split, source_name or "<in-memory DatasetDict>")
    if not isinstance(source, (str, os.PathLike)):
        raise DataFormatError(
            f"unsupported data source of type {type(source).__name__}; expected a path, a Hub dataset name, a "
            "Dataset, a DatasetDict or a list of dicts",
            source=source_name or repr(source)[:100],
        )

    text = os.fspath(source)
    name = source_name or text
    path = Path(text).expanduser()
    if path.is_dir():
        try:
            in_memory = _read_only(path) if keep_in_memory is None else keep_in_memory
            loaded = datasets.load_from_disk(str(path), keep_in_memory=in_memory)
        except Exception as error:  # any failure here means the folder is not a `save_to_disk` dataset
            raise DataFormatError(
                f"cannot read the folder as a `save_to_disk` dataset: {error}", source=name
            ) from error
        if isinstance(loaded, DatasetDict):
            return _pick_split(loaded, split, name)
        return loaded, name
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataFormatError(
                f"unsupported file extension {path.suffix!r}; expected one of {sorted(FILE_BUILDERS)}", source=name
            )
        problem = file_split_problem(path, split) or empty_file_reason(path)
        if problem:
            raise DataFormatError(problem, source=name)
        if builder == "json":
            # Arrow reads bytes that are not UTF-8 into its strings without complaint; they fail later, when a row is
            # read, without a file or line.
            check_utf8(path, source=name)
        try:
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=keep_in_memory)
            return loaded, name
        except Exception as error:  # malformed JSON/parquet, or rows whose types Arrow cannot unify
            reason = str(error) or type(error).__name__
            raise DataFormatError(f"cannot read the file as {builder}: {reason}", source=name) from error
    if looks_local(text):
        raise DataFormatError(missing_path_message(text), source=name)
    # Anything else is a Hub dataset name; `load_dataset` reports unknown names itself.
    try:
        loaded = datasets.load_dataset(text, split=split or "train", keep_in_memory=keep_in_memory)
    except Exception as error:
        # A relative path that is not there reads like `owner/name`: say both, the local path first.
        raise DataFormatError(
            f"{missing_path_message(text)}, and not a readable Hub dataset either ({error})", source=name
        ) from error
    return loaded, f"{name} [split={split or 'train'}]"


def _normalize_all(
    source: DataSource,
    split: str | None,
    source_name: str | None,
    resolve: Callable[[Any, str], Any],
    normalize: Callable[..., dict],
    num_proc: int | None,
    keep_in_memory: bool | None,
    keep_columns: tuple[str, ...] = (),
) -> Dataset:
    rows, name = read_source(source, split, source_name, keep_in_memory)
    if len(rows) == 0:
        raise DataFormatError("the data source has no rows", source=name)
    try:
        return _normalize_rows(rows, name, resolve, normalize, num_proc, keep_columns)
    except DataFormatError as error:
        raise locate_error(error, source if isinstance(source, (str, os.PathLike)) else None) from None


def holds_json_feature(feature) -> bool:
    """Whether a `datasets` feature is, or contains, a `Json` feature (datasets >= 4.7)."""
    if _JSON_FEATURE is not None and isinstance(feature, _JSON_FEATURE):
        return True
    if isinstance(feature, dict):
        return any(holds_json_feature(inner) for inner in feature.values())
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    return inner is not None and holds_json_feature(inner)


_JSON_FEATURE = getattr(datasets, "Json", None)
# Name prefix of the source columns read under another name while normalising (see `_normalize_rows`).
_HIDDEN_PREFIX = "__trl_longrm_source__"


def _normalize_rows(rows, name, resolve, normalize, num_proc, keep_columns=()) -> Dataset:
    if isinstance(rows, list):
        first = rows[0]
        columns = first.keys() if isinstance(first, dict) else []
    else:
        first, columns = rows[0], rows.column_names
    missing = [column for column in keep_columns if column not in columns]
    if missing:
        raise DataFormatError(f"no column(s) {missing} to keep; the columns are {sorted(columns)}", source=name)
    layout = resolve(columns, name)
    # Arrow needs one type per column, so every row must be of the kind (conversational or not) of the first one.
    first_record = _with_row_flags(normalize(first, index=0, source=name, layout=layout))
    expected = {key: type(value) for key, value in first_record.items()}

    kwargs = {"source": name, "layout": layout, "expected": expected, "normalize": normalize}
    if isinstance(rows, list):
        dataset = Dataset.from_list(
            [
                {**_normalize_checked(row, index, **kwargs), **{column: row[column] for column in keep_columns}}
                for index, row in enumerate(rows)
            ]
        )
    else:
        # `map` writes an output column in the type of the input column of the same name when the values fit it, and
        # a `Json` column (datasets >= 4.7: TRL's tool-call data keeps `chosen` / `rejected` message lists so) takes
        # any value: the canonical JSON text of the responses would be stored as JSON values and read back as lists
        # (a string as a list of characters). Such columns are read under other names, so the records' types are
        # inferred from the records themselves.
        hidden = {
            column: f"{_HIDDEN_PREFIX}{column}"
            for column, feature in rows.features.items()
            if holds_json_feature(feature) and column not in keep_columns
        }
        if hidden:
            rows = rows.rename_columns(hidden)
        dataset = rows.map(
            _normalize_checked,
            with_indices=True,
            fn_kwargs={**kwargs, "renamed": {new: old for old, new in hidden.items()}},
            remove_columns=[column for column in rows.column_names if column not in keep_columns],
            num_proc=num_proc,
            desc=f"Normalising {name}",
        )
    for flag in ROW_FLAGS:
        if flag in dataset.column_names and not any(dataset[flag]):
            dataset = dataset.remove_columns(flag)  # no row needs it: the records of `normalize_*_record`
    return dataset


# Keys a record has only when true (e.g. `completion_messages`): False for the other rows of a dataset, one column.
ROW_FLAGS = ("completion_messages",)


def _with_row_flags(record: dict) -> dict:
    if "prompt" in record and "chosen" in record:  # a preference group
        for flag in ROW_FLAGS:
            record.setdefault(flag, False)
    return record


def _normalize_checked(row, index, source, layout, expected, normalize, renamed=None):
    if renamed:
        row = {renamed.get(key, key): value for key, value in row.items()}
    record = _with_row_flags(normalize(row, index=index, source=source, layout=layout))
    for key, kind in {**expected, **dict.fromkeys(record.keys() - expected.keys(), type(None))}.items():
        if key not in record or not isinstance(record[key], kind):
            found = type(record[key]).__name__ if key in record else "nothing"
            wanted = "nothing" if kind is type(None) else kind.__name__
            raise DataFormatError(
                f"normalises to {found} while row 0 normalises to {wanted}; one source cannot mix "
                "conversational and standard rows, or rows with and without this column",
                source=source,
                index=index,
                key=key,
            )
    return record


# Columns of TRL's preference formats that the preference trainers cannot honour yet, and why: refused, never dropped.
UNSUPPORTED_PREFERENCE_COLUMNS = {
    "images": "vision-language preference data is not supported",
}


def resolve_supported_preference_layout(columns, data_format, prompt_key, chosen_key, rejected_key, source: str):
    """The preference layout of `columns`, after refusing by name the columns we cannot honour."""
    found = [c for c in UNSUPPORTED_PREFERENCE_COLUMNS if c in columns]
    if found:
        reasons = "; ".join(f"`{c}`: {UNSUPPORTED_PREFERENCE_COLUMNS[c]}" for c in found)
        raise DataFormatError(f"column(s) {found} cannot be honoured ({reasons}); remove them", source=source)
    return resolve_preference_layout(columns, data_format, prompt_key, chosen_key, rejected_key, source)


def load_preference_dataset(
    source: DataSource,
    split: str | None = None,
    prompt_key: str | None = None,
    chosen_key: str | None = None,
    rejected_key: str | None = None,
    data_format: str = "auto",
    source_name: str | None = None,
    num_proc: int | None = None,
    keep_in_memory: bool | None = None,
    keep_columns: tuple[str, ...] = (),
    num_rejected: int | None = None,
) -> Dataset:
    """Load preference data from any supported source as canonical groups `{prompt, chosen, rejected[, margin]}`.

    `data_format` is `"longrm"` (`chat_template`/`chosen`/`rejects`), `"trl"` (`prompt`/`chosen`/`rejected`, prompt
    possibly implicit) or `"auto"` (detected from the columns); the `*_key` arguments rename the columns read.
    `source_name` replaces the name used in messages (pass it for in-memory data); `keep_in_memory` is as in
    [`load_raw_dataset`]. `keep_columns` are source columns carried to each group unchanged (e.g. the `length`
    column a length-grouped sampler reads). `num_rejected` keeps the first `num_rejected` rejected responses of each
    row (see [`normalize_preference_record`]).

    Example:
    ```python
    >>> ds = load_preference_dataset("/path/to/longrm_simpo_sample", split="train")
    >>> ds.column_names
    ['prompt', 'chosen', 'rejected']
    ```
    """

    def resolve(columns, name):
        return resolve_supported_preference_layout(columns, data_format, prompt_key, chosen_key, rejected_key, name)

    normalize = normalize_preference_record
    if num_rejected is not None:
        normalize = functools.partial(normalize_preference_record, num_rejected=num_rejected)
    return _normalize_all(source, split, source_name, resolve, normalize, num_proc, keep_in_memory, tuple(keep_columns))


def load_sft_dataset(
    source: DataSource,
    split: str | None = None,
    messages_key: str | None = None,
    data_format: str = "auto",
    prompt_key: str | None = None,
    completion_key: str | None = None,
    source_name: str | None = None,
    num_proc: int | None = None,
    keep_in_memory: bool | None = None,
) -> Dataset:
    """Load SFT data from any supported source as `{messages}` (conversational) or `{prompt, completion}` rows.

    `data_format` is `"longrm"` (`chat_template` + `golden`, appended as the final assistant turn), `"trl"`
    (`messages`, or `prompt` + `completion`) or `"auto"`; `messages_key`, `prompt_key` and `completion_key` rename
    the columns read (for LongRM, `completion_key` names the answer column). `source_name` and `keep_in_memory` are
    as in [`load_preference_dataset`].

    Example:
    ```python
    >>> ds = load_sft_dataset([{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}])
    >>> ds.column_names
    ['messages']
    ```
    """

    def resolve(columns, name):
        return resolve_sft_layout(columns, data_format, messages_key, prompt_key, completion_key, name)

    return _normalize_all(source, split, source_name, resolve, normalize_sft_record, num_proc, keep_in_memory)
