"""Long-RewardBench loading: the fixture generator's layout, record ids, and errors naming file, line and key."""

import json
from collections import Counter

import pytest

from trl_longrm.evaluation import FORMATS, LENGTH_BUCKETS, TASKS, load_benchmark, make_toy_benchmark


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def _pairwise(**overrides):
    row = {
        "prompt_template": [{"role": "user", "content": "doc"}, {"role": "user", "content": "Q?"}],
        "chosen": "good",
        "rejected": "bad",
        "tasktype": "PairWise",
        "subtype": "same",
        "ctx_length_for_length": "8k",
        "source": "s",
    }
    row.update(overrides)
    return row


def test_toy_benchmark_has_the_real_layout(tmp_path):
    path = make_toy_benchmark(tmp_path / "bench", pairwise_per_task=4, bestofn_per_task=3)
    assert sorted(p.name for p in path.iterdir()) == sorted(f"{t}.jsonl" for t in TASKS)
    records = load_benchmark(path, list(TASKS), list(FORMATS))
    assert len(records) == 7 * 7
    assert Counter(r.tasktype for r in records) == {"PairWise": 28, "BestOfN": 21}
    assert Counter(r.subtype for r in records if r.tasktype == "BestOfN") == {"2": 7, "3": 7, "4": 7}
    assert {r.subtype == "same" for r in records if r.tasktype == "PairWise"} == {True, False}
    assert {r.length for r in records} == set(LENGTH_BUCKETS[:4])
    for record in records:
        n = int(record.subtype) if record.tasktype == "BestOfN" else 2
        assert len(record.candidates) == n
        # Candidates are stored best first: the correct answer quotes the document.
        assert "as the document states" in record.candidates[0]
    # Longer buckets have longer contexts.
    size = {r.length: len(r.task_prompt) for r in records if r.task == "LongQA"}
    assert size["4k"] < size["8k"] < size["16k"] < size["32k"]


def test_task_prompt_joins_messages_and_filters_formats(tmp_path):
    _write(
        tmp_path / "Math.jsonl",
        [_pairwise(id="a"), {**_pairwise(id="b"), "tasktype": "BestOfN", "candidates": ["x", "y", "z"], "subtype": 3}],
    )
    records = load_benchmark(tmp_path, ["Math"], ["PairWise"])
    assert [r.id for r in records] == ["Math/a"]
    assert records[0].task_prompt == "doc\n\nQ?"
    assert records[0].candidates == ["good", "bad"]
    both = load_benchmark(tmp_path, ["Math"], ["PairWise", "BestOfN"])
    assert [r.subtype for r in both] == ["same", "3"]


def test_ids_are_derived_from_task_and_line_when_missing(tmp_path):
    path = make_toy_benchmark(tmp_path, tasks=["Code"], pairwise_per_task=2, bestofn_per_task=1, with_ids=False)
    records = load_benchmark(path, ["Code"], list(FORMATS))
    assert [r.id for r in records] == ["Code/L1", "Code/L2", "Code/L3"]


@pytest.mark.parametrize(
    "row, key",
    [
        ({k: v for k, v in _pairwise().items() if k != "chosen"}, "chosen"),
        ({k: v for k, v in _pairwise().items() if k != "ctx_length_for_length"}, "ctx_length_for_length"),
        (_pairwise(tasktype="Pointwise"), "tasktype"),
        (_pairwise(prompt_template="just text"), "prompt_template"),
        (_pairwise(prompt_template=[{"role": "user"}]), "prompt_template[0]"),
        (_pairwise(rejected=["a", "b"]), "rejected"),
        ({**_pairwise(tasktype="BestOfN"), "candidates": ["only one"]}, "candidates"),
        (_pairwise(tasktype="BestOfN"), "candidates"),
    ],
)
def test_bad_record_names_file_line_and_key(tmp_path, row, key):
    _write(tmp_path / "Safety.jsonl", [_pairwise(), _pairwise(), row])
    with pytest.raises(ValueError) as error:
        load_benchmark(tmp_path, ["Safety"], list(FORMATS))
    message = str(error.value)
    assert str(tmp_path / "Safety.jsonl") in message and "line 3" in message and f"`{key}`" in message


def test_bad_json_duplicate_ids_and_missing_files(tmp_path):
    (tmp_path / "ICL.jsonl").write_text(json.dumps(_pairwise()) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"ICL\.jsonl, line 2: not valid JSON"):
        load_benchmark(tmp_path, ["ICL"], list(FORMATS))
    _write(tmp_path / "Cite.jsonl", [_pairwise(id=7), _pairwise(id=8), _pairwise(id=7)])
    with pytest.raises(ValueError, match=r"Cite\.jsonl, line 3: key `id` duplicates the record on line 1"):
        load_benchmark(tmp_path, ["Cite"], list(FORMATS))
    with pytest.raises(FileNotFoundError, match=r"Summ\.jsonl .*the directory has the tasks \['Cite', 'ICL'\]"):
        load_benchmark(tmp_path, ["Summ"], list(FORMATS))


def test_task_names_match_ignoring_case(tmp_path):
    _write(tmp_path / "LongQA.jsonl", [_pairwise(id="a")])
    records = load_benchmark(tmp_path, ["longqa"], list(FORMATS))
    # The record carries the file's spelling of the task, as a full run's predictions do.
    assert [(r.task, r.id) for r in records] == [("LongQA", "LongQA/a")]


def test_package_exports_resolve_lazily():
    import trl_longrm.evaluation as evaluation

    assert sorted(evaluation.__all__) == sorted(evaluation._MODULE_OF)
    assert all(getattr(evaluation, name) is not None for name in evaluation.__all__)
    with pytest.raises(AttributeError):
        evaluation.not_a_name  # noqa: B018
