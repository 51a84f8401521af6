"""Build offline stand-ins of the `trl-internal-testing` datasets by running TRL's own generation scripts.

TRL's tests load `trl-internal-testing/zen`, `.../toolcall` and `.../harmony` from the Hub. These datasets are made by
TRL's `scripts/generate_{zen,toolcall,harmony}_dataset.py`, which end in `DatasetDict.push_to_hub`. Here that call is
replaced by a local save: one parquet file per config and split under `<hub>/trl-internal-testing/<name>/`, plus a
README.md whose `configs:` YAML maps config names to files, so that `load_dataset("trl-internal-testing/zen",
"standard_preference")` run from `<hub>` resolves to the local folder with the same configs and splits.

The scripts are read from a TRL checkout (`--trl-src`, extracted by `run.py`); none is copied into this repository.
The toolcall generator is taken from an older revision (`--toolcall-script`): the Hub copy of `toolcall` still holds
`tools` as JSON strings (the tests call `json.loads(example["tools"])`), while the script at TRL main writes them as
structured values. Its message lists (`messages`, `chosen`, `rejected`), on the other hand, are stored as the
generator at TRL main stores them, with datasets' `Json` feature (`Dataset.from_dict(..., on_mixed_types="use_json")`,
`arrow.json` in the parquet files): each message keeps only its own keys (a tool call has no `content`, a tool answer
has a `name`). Inferred as structs instead, every message would get the keys of all the others, filled with None,
which hides what a trainer does with the Hub's data. The toolcall generator therefore runs with `use_json` as the
default of `Dataset.from_dict`. After the build this module checks both: `tools` is a column of JSON strings, and the
message lists are `Json` values.

    python datasets_stand_ins.py --trl-src WORK/trl --toolcall-script WORK/trl/toolcall/generate_toolcall_dataset.py \
        --hub WORK/hubroot
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict, Features, Json, List


# The test split fraction the scripts use by default (their `test_size` argument).
TEST_SIZE = 0.1


class LocalHub:
    """Replacement for `DatasetDict.push_to_hub` that writes parquet files under a local hub root."""

    def __init__(self, root: Path):
        self.root = root
        self.configs: dict[str, dict[str, dict[str, str]]] = defaultdict(dict)  # repo -> config -> split -> file

    def push(self, dataset_dict: DatasetDict, repo_id: str, config_name: str = "default", **_kwargs) -> None:
        for split, dataset in dataset_dict.items():
            relative = f"{config_name}/{split}-00000-of-00001.parquet"
            path = self.root / repo_id / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            dataset.to_parquet(str(path))
            self.configs[repo_id].setdefault(config_name, {})[split] = relative

    def write_cards(self) -> None:
        """Write each dataset's README.md: without its `configs:` list, `load_dataset(repo, config)` finds none."""
        for repo_id, configs in self.configs.items():
            lines = ["---", "configs:"]
            for config_name, splits in configs.items():
                lines += [f"- config_name: {config_name}", "  data_files:"]
                for split, relative in splits.items():
                    lines += [f"  - split: {split}", f"    path: {relative}"]
            lines.append("---\n")
            (self.root / repo_id / "README.md").write_text("\n".join(lines), encoding="utf-8")


def load_script(path: Path, module_name: str):
    """Import a generator script from its file (the scripts folder is not a package)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_toolcall_tools_are_json_strings(root: Path) -> None:
    """Fail unless every `tools` value of the toolcall stand-in is a JSON string, as TRL main's tests read it."""
    files = sorted((root / "trl-internal-testing" / "toolcall").glob("*/*.parquet"))
    if not files:
        raise SystemExit("toolcall stand-in: no parquet file was written")
    for path in files:
        table = pq.read_table(path)
        if "tools" not in table.column_names:
            continue
        for value in table.column("tools").to_pylist():
            if value is None:
                continue
            if not isinstance(value, str) or not isinstance(json.loads(value), list):
                raise SystemExit(
                    f"toolcall stand-in {path}: `tools` holds {type(value).__name__}, not a JSON string; the tests "
                    "call json.loads(example['tools']). Use a generator revision that writes json.dumps(...) "
                    "(run.py --toolcall-commit)."
                )


# Columns of the toolcall configs holding lists of messages, stored as `List(Json())` as on the Hub.
TOOLCALL_MESSAGE_COLUMNS = ("messages", "chosen", "rejected")


def check_toolcall_messages_are_json(root: Path) -> None:
    """Fail unless every message list of the toolcall stand-in is stored with datasets' `Json` feature."""
    for path in sorted((root / "trl-internal-testing" / "toolcall").glob("*/*.parquet")):
        features = Features.from_arrow_schema(pq.read_schema(path))
        for column in TOOLCALL_MESSAGE_COLUMNS:
            if column in features and features[column] != List(Json()):
                raise SystemExit(
                    f"toolcall stand-in {path}: `{column}` is stored as {features[column]}, not as a list of Json "
                    "values as on the Hub (TRL's generator builds it with on_mixed_types='use_json')."
                )


class JsonDefault:
    """`Dataset.from_dict` with `on_mixed_types="use_json"` unless the caller passes it, while in this context."""

    def __enter__(self):
        self.original = Dataset.from_dict.__func__

        def from_dict(cls, *args, **kwargs):
            kwargs.setdefault("on_mixed_types", "use_json")
            return self.original(cls, *args, **kwargs)

        Dataset.from_dict = classmethod(from_dict)
        return self

    def __exit__(self, *exc):
        Dataset.from_dict = classmethod(self.original)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-src", type=Path, required=True, help="folder with TRL's scripts/ (extracted by run.py)")
    parser.add_argument("--toolcall-script", type=Path, required=True, help="generate_toolcall_dataset.py to run")
    parser.add_argument("--hub", type=Path, required=True, help="local hub root to write into")
    args = parser.parse_args(argv)

    hub = LocalHub(args.hub.resolve())
    # A plain function, so that the DatasetDict the script calls it on arrives as the first argument.
    DatasetDict.push_to_hub = lambda dataset_dict, *args, **kwargs: hub.push(dataset_dict, *args, **kwargs)
    generators = [
        (args.trl_src / "scripts" / "generate_zen_dataset.py", "trl-internal-testing/zen"),
        (args.toolcall_script, "trl-internal-testing/toolcall"),
        (args.trl_src / "scripts" / "generate_harmony_dataset.py", "trl-internal-testing/harmony"),
    ]
    for path, repo_id in generators:
        module = load_script(path, f"_trl_dataset_script_{path.stem}")
        if repo_id.endswith("/toolcall"):
            with JsonDefault():
                module.main(TEST_SIZE, True, repo_id)
        else:
            module.main(TEST_SIZE, True, repo_id)
    hub.write_cards()
    check_toolcall_tools_are_json_strings(hub.root)
    check_toolcall_messages_are_json(hub.root)
    for repo_id, configs in hub.configs.items():
        print(f"[dataset] {repo_id}: {len(configs)} configs ({', '.join(configs)})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
