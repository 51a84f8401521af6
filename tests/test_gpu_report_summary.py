"""`bench/gpu_longest_row.py`'s summary of a GPU report (what `summary.json` publishes), on hand-made reports: a GPU
call is rare, so a report it returns must not fail to summarise."""

import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def long_rows_attempt(length, long_rows, status, peak_gib=None, steps=()):
    record = {"trainer": "grm", "impl": "ours", "prompt_length": length, "long_rows": long_rows, "status": status}
    if status == "ok":
        record.update(peak_mem_bytes=int(peak_gib * 2**30), step_seconds=list(steps))
    return record


@pytest.fixture
def summary():
    from gpu_longest_row import summary

    return summary


def test_long_rows_pairs_are_summarised_by_how_they_ended(summary):
    report = {"gpu": "H100", "versions": {}, "throughput": [], "longest_row": [], "long_rows": [
        # Both train (three steps each): the memory ratio and the median step after the first.
        long_rows_attempt(65536, False, "ok", 11.7, (9.0, 8.3, 8.2, 8.4)),
        long_rows_attempt(65536, True, "ok", 7.2, (9.5, 8.8, 8.7, 8.75)),
        # One step each: the memory ratio only.
        long_rows_attempt(131072, False, "ok", 20.0, (30.0,)),
        long_rows_attempt(131072, True, "ok", 12.0, (31.0,)),
        # Past what trains without the long-row settings: how each ended, and the peak of the one that trained.
        long_rows_attempt(557056, False, "oom"),
        long_rows_attempt(557056, True, "ok", 39.0, (150.0,)),
        # One of a pair only (a call cut short): nothing.
        long_rows_attempt(1048576, True, "timeout"),
    ]}  # fmt: skip
    out = summary(report)
    assert out["long_rows_peak_ratio_65536"] == pytest.approx(7.2 / 11.7, rel=1e-6)
    assert out["long_rows_step_ratio_65536"] == pytest.approx(8.75 / 8.3)
    assert out["long_rows_peak_ratio_131072"] == pytest.approx(12.0 / 20.0, rel=1e-6)
    assert "long_rows_step_ratio_131072" not in out
    assert out["long_rows_status_557056"] == {"without": "oom", "with": "ok"}
    assert out["long_rows_peak_gib_557056"] == 39.0
    assert not any(key.endswith("1048576") for key in out)
