"""`mix`: long and short data into one training set, by counts or by ratios (LongRM: stage I mixes its long judging
data with short public reward-model data turned into judgments; `docs/data.md` lists the paper's mixes).

Each source is read and normalised by `trl_longrm.data` (any format the trainers read: LongRM's or TRL's), so the
mix is in one canonical format: preference groups (`prompt`, `chosen`, `rejected`) or SFT examples (`messages`, or
`prompt` + `completion`), plus `source`, the name of the source a row came from. A source gives `count` rows, or
`ratio` of `total`; a source with fewer rows than asked is an error unless `replace` draws with replacement. Rows
are drawn and shuffled with `seed`.

Example:
```python
>>> mix(MixConfig(output="stage1.jsonl", total=10000, sources=[
...     {"path": "sft_long.jsonl", "ratio": 0.8}, {"path": "sft_short.jsonl", "ratio": 0.2}]))
```
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from trl_longrm.data.errors import DataFormatError, RunConfigError
from trl_longrm.datagen.records import write_jsonl
from trl_longrm.datagen.summary import StepStats


SOURCE_KEYS = {"path", "split", "count", "ratio", "name", "replace"}


@dataclass
class MixConfig:
    """Settings of `mix` (the `trl-longrm data mix` flags; `sources` takes one YAML mapping per source:
    `{path, count | ratio, split, name, replace}`).

    Example:
    ```python
    >>> config = MixConfig(output="mix.jsonl", sources=[{"path": "long.jsonl", "count": 5000},
    ...                                                 {"path": "skywork.jsonl", "count": 50000}])
    ```
    """

    output: str = field(metadata={"help": "Output JSON Lines file."})
    sources: list = field(
        default_factory=list,
        metadata={"help": "Sources: mappings `{path, count | ratio, split, name, replace}`."},
    )
    kind: str = field(
        default="auto",
        metadata={"help": "'preference', 'sft' or 'auto' (from the first source's columns). Default auto.",
                  "choices": ["auto", "preference", "sft"]},
    )  # fmt: skip
    total: int | None = field(default=None, metadata={"help": "Rows of the mix, for sources given by `ratio`."})
    seed: int = field(default=0, metadata={"help": "Seed of the draws and the shuffle. Default 0."})

    def __post_init__(self):
        if not isinstance(self.sources, list) or not self.sources:
            raise RunConfigError("mix: give `sources`, a list of mappings with `path` and `count` or `ratio`")
        for i, source in enumerate(self.sources):
            where = f"mix: sources[{i}]"
            if not isinstance(source, Mapping) or "path" not in source:
                raise RunConfigError(f"{where}: a source is a mapping with `path` and `count` or `ratio`")
            unknown = sorted(set(source) - SOURCE_KEYS)
            if unknown:
                raise RunConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(SOURCE_KEYS)}")
            if ("count" in source) == ("ratio" in source):
                raise RunConfigError(f"{where} ({source['path']}): give exactly one of `count` and `ratio`")
            if "ratio" in source and self.total is None:
                raise RunConfigError(f"{where} ({source['path']}): a `ratio` needs the mix's `total`")
            if "count" in source and (not isinstance(source["count"], int) or source["count"] < 0):
                raise RunConfigError(f"{where}: `count` must be an integer >= 0, got {source['count']!r}")
            if "ratio" in source and not (isinstance(source["ratio"], (int, float)) and 0 <= source["ratio"] <= 1):
                raise RunConfigError(f"{where}: `ratio` must be in [0, 1], got {source['ratio']!r}")
        if self.kind not in ("auto", "preference", "sft"):
            raise RunConfigError(f"mix: `kind` must be auto, preference or sft, got {self.kind!r}")


def _kind_of(path, split) -> str:
    from trl_longrm.data.sources import load_raw_dataset

    rows = load_raw_dataset(path, split=split)
    columns = set(rows[0]) if isinstance(rows, list) else set(rows.column_names)
    return "preference" if {"rejects", "rejected"} & columns else "sft"


def mix(config: MixConfig) -> dict:
    """Draw each source's rows, shuffle them together and write `config.output` (whole, at once); returns the summary."""
    from trl_longrm.data import load_preference_dataset, load_sft_dataset

    kind = config.kind
    if kind == "auto":
        kind = _kind_of(config.sources[0]["path"], config.sources[0].get("split"))
    load = load_preference_dataset if kind == "preference" else load_sft_dataset
    rng = random.Random(config.seed)
    rows, counts, columns = [], {}, None
    for source in config.sources:
        name = source.get("name") or str(source["path"])
        dataset = load(source["path"], split=source.get("split"))
        wanted = source["count"] if "count" in source else round(source["ratio"] * config.total)
        if wanted > len(dataset) and not source.get("replace"):
            raise DataFormatError(
                f"{wanted} rows asked of {len(dataset)}; lower `count` / `ratio`, or set `replace: true`",
                source=str(source["path"]),
            )
        if columns is None:
            columns, first = set(dataset.column_names), name
        elif set(dataset.column_names) != columns:
            raise DataFormatError(
                f"normalises to the columns {sorted(dataset.column_names)}, {first} to {sorted(columns)}: one mix "
                "cannot hold both (conversational and plain-text rows, or rows with and without margins or tools)",
                source=str(source["path"]),
            )
        if source.get("replace"):
            picked = [rng.randrange(len(dataset)) for _ in range(wanted)]
        else:
            picked = rng.sample(range(len(dataset)), wanted)
        rows += [{**dataset[index], "source": name} for index in picked]
        counts[name] = counts.get(name, 0) + wanted
    rng.shuffle(rows)
    stats = StepStats("mix", config.output, len(rows), unit="row")
    stats.written = write_jsonl(config.output, rows)
    stats.advance(len(rows))
    stats.extra.update(kind=kind, rows_by_source=counts)
    return stats.finish()
