"""Resumability and batching: a killed run loses and duplicates nothing, and results never depend on batch size."""

import json

import pytest

from trl_longrm.evaluation import EvalConfig, ScriptedJudge, evaluate_reward_model, make_toy_benchmark


def _respond(request):
    """Prefers shorter responses; answers garbage for every third record (by id), so some verdicts are unparseable."""
    if int(request.record_id.split("-")[-1]) % 3 == 2:
        return "no idea"
    best_first = sorted(range(len(request.responses)), key=lambda p: (len(request.responses[p]), p))
    return (
        "[[" + ">".join(chr(ord("A") + p) for p in best_first) + "]]"
        if request.ranking
        else f"[[{'AB'[best_first[0]]}]]"
    )


class KilledJudge(ScriptedJudge):
    """Raises (like a killed process) once `limit` records have been judged."""

    def __init__(self, limit):
        super().__init__(_respond)
        self.limit = limit

    def judge(self, requests):
        if len(self.judged) + len(requests) > self.limit:
            raise KeyboardInterrupt("killed")
        return super().judge(requests)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return str(make_toy_benchmark(tmp_path_factory.mktemp("bench"), pairwise_per_task=3, bestofn_per_task=3))


def _run(bench, save_path, batch_size=1, judge=None, **kwargs):
    config = EvalConfig(
        model_path="scripted", data_path=bench, save_path=str(save_path), batch_size=batch_size, **kwargs
    )
    return evaluate_reward_model(config, judge=judge or ScriptedJudge(_respond))


def _lines(save_path):
    return [json.loads(line) for line in (save_path / "predictions.jsonl").read_text().splitlines()]


def _metrics(results):
    return {k: v for k, v in results.items() if k != "config"}


def test_batch_size_does_not_change_results(bench, tmp_path):
    one = _run(bench, tmp_path / "bs1", batch_size=1)
    four = _run(bench, tmp_path / "bs4", batch_size=4)
    assert _metrics(one) == _metrics(four)
    assert one["unparseable"]["total"] == 14  # records 2 and 5 of each task
    key = lambda p: p["id"]  # noqa: E731
    assert sorted(_lines(tmp_path / "bs1"), key=key) == sorted(_lines(tmp_path / "bs4"), key=key)


def test_kill_and_resume_matches_an_uninterrupted_run(bench, tmp_path):
    reference = _run(bench, tmp_path / "full", batch_size=4)
    with pytest.raises(KeyboardInterrupt):
        _run(bench, tmp_path / "killed", batch_size=4, judge=KilledJudge(limit=18))
    assert len(_lines(tmp_path / "killed")) == 16  # four whole batches were written before the kill
    resumed_judge = ScriptedJudge(_respond)
    resumed = _run(bench, tmp_path / "killed", batch_size=3, judge=resumed_judge)
    assert len(resumed_judge.judged) == 42 - 16  # only the missing records were judged
    assert _metrics(resumed) == _metrics(reference)
    ids = [p["id"] for p in _lines(tmp_path / "killed")]
    assert len(ids) == len(set(ids)) == 42
    # A finished run re-run judges nothing and reports the same.
    idle = ScriptedJudge(_respond)
    assert _metrics(_run(bench, tmp_path / "killed", judge=idle)) == _metrics(reference) and idle.judged == []


def test_torn_last_line_is_dropped_and_redone(bench, tmp_path):
    reference = _run(bench, tmp_path / "run")
    path = tmp_path / "run" / "predictions.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 25])  # kill in the middle of writing the last line
    judge = ScriptedJudge(_respond)
    resumed = _run(bench, tmp_path / "run", judge=judge)
    assert judge.judged == [reference_line["id"] for reference_line in _lines(tmp_path / "run")[-1:]]
    assert _metrics(resumed) == _metrics(reference)
    assert path.read_bytes() == data


def test_corrupt_middle_line_and_changed_settings_are_errors(bench, tmp_path):
    _run(bench, tmp_path / "run", tasks=["Math"])
    with pytest.raises(ValueError, match=r"different run \(seed: 42 -> 7\)"):
        _run(bench, tmp_path / "run", tasks=["Math"], seed=7)
    path = tmp_path / "run" / "predictions.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2] + ["{broken\n"] + lines[3:]))
    with pytest.raises(ValueError, match=r"predictions\.jsonl, line 3: not valid JSON"):
        _run(bench, tmp_path / "run", tasks=["Math"])


def test_records_do_not_depend_on_which_others_run(bench, tmp_path):
    full = {p["id"]: p for p in (_run(bench, tmp_path / "all", batch_size=5) and _lines(tmp_path / "all"))}
    _run(bench, tmp_path / "math", tasks=["Math"], formats=["BestOfN"])
    subset = _lines(tmp_path / "math")
    assert len(subset) == 3 and all(full[p["id"]] == p for p in subset)
