"""Loading from every kind of source, errors naming the file and row, and the real LongRM sample."""

import json
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from trl_longrm.data import (
    DataFormatError,
    load_preference_dataset,
    load_raw_dataset,
    load_sft_dataset,
    read_source,
)


USER = {"role": "user", "content": "Read the context and judge the response."}


def longrm_rows(n=3):
    return [
        {
            "chat_template": [{"role": "system", "content": "Rubric"}, {**USER, "content": f"{USER['content']} #{i}"}],
            "chosen": f"[Score: {9 - i}]",
            "rejects": [f"[Score: {i}]", f"[Score: {i + 1}]"],
            "prompt_ctx_length": 100 + i,
        }
        for i in range(n)
    ]


def expected_groups(rows):
    return [{"prompt": r["chat_template"], "chosen": r["chosen"], "rejected": r["rejects"]} for r in rows]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "save_to_disk", "save_to_disk_dict", "dataset", "list"])
def test_every_source_kind_gives_the_same_groups(tmp_path, kind):
    rows = longrm_rows()
    if kind == "jsonl":
        source = write_jsonl(tmp_path / "groups.jsonl", rows)
    elif kind == "json":
        source = tmp_path / "groups.json"
        source.write_text(json.dumps(rows))
    elif kind == "parquet":
        source = tmp_path / "groups.parquet"
        Dataset.from_list(rows).to_parquet(str(source))
    elif kind == "save_to_disk":
        source = tmp_path / "groups"
        Dataset.from_list(rows).save_to_disk(str(source))
    elif kind == "save_to_disk_dict":
        source = tmp_path / "groups_dict"
        DatasetDict({"train": Dataset.from_list(rows[:1]), "eval": Dataset.from_list(rows)}).save_to_disk(str(source))
    elif kind == "dataset":
        source = Dataset.from_list(rows)
    else:
        source = rows
    split = "eval" if kind == "save_to_disk_dict" else None
    dataset = load_preference_dataset(source, split=split)
    assert sorted(dataset.column_names) == ["chosen", "prompt", "rejected"]
    assert dataset.to_list() == expected_groups(rows)


def test_dataset_dict_defaults_to_train_and_names_split(tmp_path):
    rows = longrm_rows(4)
    folder = tmp_path / "dd"
    DatasetDict({"train": Dataset.from_list(rows[:2]), "test": Dataset.from_list(rows[2:])}).save_to_disk(str(folder))
    assert load_preference_dataset(folder).to_list() == expected_groups(rows[:2])
    rows_read, name = read_source(folder, split="test")
    assert name == f"{folder} [split=test]" and rows_read.to_list() == rows[2:]
    with pytest.raises(DataFormatError, match=r"dd \[split=validation\]|split 'validation' not found") as info:
        load_preference_dataset(folder, split="validation")
    assert str(folder) in str(info.value) and "['test', 'train']" in str(info.value)


def test_errors_from_files_name_the_path_row_and_key(tmp_path):
    rows = longrm_rows(4)
    rows[3]["rejects"] = []
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    # A blank line holds no row: row 3 (0-based) is then on line 5 of the file, which is what the message names.
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2] + ["\n"] + lines[2:]))
    with pytest.raises(DataFormatError) as info:
        load_preference_dataset(path)
    assert (info.value.source, info.value.index, info.value.key, info.value.line) == (str(path), 3, "rejects", 5)
    assert str(info.value).startswith(f"{path}, line 5, key 'rejects':")
    assert path.read_text().splitlines()[4] == json.dumps(rows[3])

    rows = longrm_rows(3)
    rows[1]["chat_template"][0]["role"] = "oracle"
    folder = tmp_path / "bad_disk"
    Dataset.from_list(rows).save_to_disk(str(folder))
    with pytest.raises(DataFormatError, match=rf"^{folder}, row 1, key 'chat_template\[0\].role': unknown role"):
        load_preference_dataset(folder)


def test_unreadable_sources(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataFormatError, match=rf"^{missing}: no such file"):
        load_preference_dataset(missing)
    other = tmp_path / "data.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(DataFormatError, match=r"unsupported file extension '.csv'"):
        load_preference_dataset(other)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"chosen": "a", "rejects": ["b"]\nnot json\n')
    with pytest.raises(DataFormatError, match=rf"^{broken}: cannot read the file as json"):
        load_preference_dataset(broken)
    not_a_dataset = tmp_path / "folder"
    not_a_dataset.mkdir()
    with pytest.raises(DataFormatError, match=rf"^{not_a_dataset}: cannot read the folder"):
        load_preference_dataset(not_a_dataset)
    with pytest.raises(DataFormatError, match="unsupported data source of type int"):
        load_raw_dataset(42)
    with pytest.raises(DataFormatError, match="no rows"):
        load_preference_dataset([], source_name="empty")


def test_empty_files_say_why(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataFormatError, match=rf"^{empty}: the file is empty$"):
        load_preference_dataset(empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    with pytest.raises(DataFormatError, match=rf"^{blank}: the file holds only blank lines$"):
        load_preference_dataset(blank)


@pytest.mark.parametrize("split", ["test", "validation"])
def test_a_split_other_than_train_cannot_apply_to_a_single_file(tmp_path, split):
    path = write_jsonl(tmp_path / "prefs.jsonl", longrm_rows(3))
    with pytest.raises(DataFormatError, match=rf"^{path}: split '{split}' cannot apply: a single .jsonl file"):
        load_raw_dataset(path, split=split)
    assert len(load_raw_dataset(path, split="train")) == len(load_raw_dataset(path)) == 3


def test_missing_relative_paths_are_missing_paths_not_hub_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("data/nope", "runs/a/nope", "./nope", "nope.jsonl"):
        with pytest.raises(DataFormatError) as info:
            load_raw_dataset(name)
        assert str(info.value) == f"{name}: no such file or folder (resolved against {tmp_path})", name
    missing = tmp_path / "abs" / "nope"
    with pytest.raises(DataFormatError, match=rf"^{missing}: no such file or folder$"):
        load_raw_dataset(str(missing))
    # `owner/name` with no local `owner/` folder may be a Hub id; offline, both readings are reported.
    with pytest.raises(DataFormatError, match=r"^someone/nope: no such file or folder \(resolved against .*Hub"):
        load_raw_dataset("someone/nope")


def test_trl_formats_from_jsonl(tmp_path):
    conversational = [
        {
            "chosen": [USER, {"role": "assistant", "content": f"good {i}"}],
            "rejected": [USER, {"role": "assistant", "content": f"bad {i}"}],
            "margin": float(i),
        }
        for i in range(3)
    ]
    dataset = load_preference_dataset(write_jsonl(tmp_path / "implicit.jsonl", conversational))
    assert dataset["prompt"] == [[USER]] * 3
    assert dataset["chosen"] == ["good 0", "good 1", "good 2"]
    assert dataset["rejected"] == [["bad 0"], ["bad 1"], ["bad 2"]]
    assert dataset["margin"] == [0.0, 1.0, 2.0]

    standard = [{"prompt": "Q: 1+1? A:", "chosen": " 2", "rejected": [" 3", " 11"]}] * 2
    dataset = load_preference_dataset(write_jsonl(tmp_path / "standard.jsonl", standard), data_format="trl")
    assert dataset.to_list() == [{"prompt": "Q: 1+1? A:", "chosen": " 2", "rejected": [" 3", " 11"]}] * 2


def test_sft_sources(tmp_path):
    messages = [{"messages": [USER, {"role": "assistant", "content": f"answer {i}"}]} for i in range(2)]
    path = tmp_path / "sft.parquet"
    Dataset.from_list(messages).to_parquet(str(path))
    assert load_sft_dataset(path).to_list() == messages
    pc = [{"prompt": "2+2=", "completion": " 4"}]
    assert load_sft_dataset(write_jsonl(tmp_path / "pc.jsonl", pc)).to_list() == pc


def test_read_only_save_to_disk_folder_gets_no_cache_files(tmp_path):
    folder = tmp_path / "ro"
    Dataset.from_list(longrm_rows()).save_to_disk(str(folder))
    before = sorted(p.name for p in folder.iterdir())
    folder.chmod(0o555)
    try:
        dataset = load_preference_dataset(folder)
        assert dataset.cache_files == [] and len(dataset) == 3
        assert sorted(p.name for p in folder.iterdir()) == before
    finally:
        folder.chmod(0o755)


def _read_only_copy(source, target):
    """A copy of a dataset folder with its write bits cleared (what `../shared` is in CI; a newcomer's may not be)."""
    import shutil
    import stat

    shutil.copytree(source, target)
    for path in sorted(target.rglob("*"), key=lambda p: -len(p.parts)) + [target]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return target


def test_shared_longrm_sample_normalises_to_16_groups(shared_sample_path, tmp_path):
    dataset = load_preference_dataset(shared_sample_path, split="train")
    assert len(dataset) == 16
    assert all(len(rejected) == 4 for rejected in dataset["rejected"])
    # A read-only dataset folder (made here: `../shared` need not be) is read into memory: no cache files are written
    # into the user's folder.
    read_only = _read_only_copy(Path(shared_sample_path), tmp_path / "read_only")
    before = sorted(p.relative_to(read_only) for p in read_only.rglob("*"))
    raw = load_raw_dataset(str(read_only), split="train")
    assert raw.cache_files == [] and sorted(p.relative_to(read_only) for p in read_only.rglob("*")) == before
    assert load_raw_dataset(shared_sample_path, split="train")["chosen"] == raw["chosen"]
    for record, row in zip(dataset, raw):
        assert record["prompt"] == row["chat_template"] and [m["role"] for m in record["prompt"]] == ["system", "user"]
        assert record["chosen"] == row["chosen"] and record["rejected"] == row["rejects"]
    assert len(load_preference_dataset(shared_sample_path, split="eval")) == 2


def test_preference_columns_we_cannot_honour_are_refused_where_read(tmp_path):
    import json

    from trl_longrm.data import DataFormatError, load_preference_dataset

    path = tmp_path / "pref.jsonl"
    row = {"prompt": "q", "chosen": "a", "rejected": "b", "images": ["x.png"]}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataFormatError, match=r"pref\.jsonl.*\['images'\] cannot be honoured"):
        load_preference_dataset(str(path))
    # Template arguments need a chat template: a plain-text row with them is refused on its line, naming the key.
    plain = {"prompt": "q", "chosen": "a", "rejected": "b", "chat_template_kwargs": {}}
    path.write_text(json.dumps(plain) + "\n" + json.dumps({**plain, "chat_template_kwargs": {"x": 1}}) + "\n")
    with pytest.raises(DataFormatError, match=r"pref\.jsonl.*line 2.*chat_template_kwargs.*plain-text prompt"):
        load_preference_dataset(str(path))
    chat = {
        "prompt": [{"role": "user", "content": "q"}],
        "chosen": [{"role": "assistant", "content": "a"}],
        "rejected": [{"role": "assistant", "content": "b"}],
        "tools": "[not json",
    }
    path.write_text(json.dumps(chat) + "\n")
    with pytest.raises(DataFormatError, match=r"pref\.jsonl.*line 1.*tools.*does not parse"):
        load_preference_dataset(str(path))
