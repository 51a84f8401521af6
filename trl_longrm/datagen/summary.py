"""What a data step did, shown as it runs and kept when it ends: a progress bar with its ETA, and a summary (records,
requests, prompt and generated tokens, answers read from the cache, records dropped and why) printed and written to
`<output>.summary.json`."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path

from trl_longrm.datagen.records import SUMMARY_SUFFIX


logger = logging.getLogger(__name__)


class StepStats:
    """The counters of one run of a step and its progress bar (records done of `total`, `resumed` of them from an
    earlier run).

    Example:
    ```python
    >>> stats = StepStats("judge", "judged.jsonl", total=1000, resumed=250)
    >>> stats.requests += 5; stats.advance(1)
    >>> summary = stats.finish()
    ```
    """

    def __init__(self, step: str, output: str | Path, total: int, resumed: int = 0, unit: str = "record"):
        from tqdm.auto import tqdm

        self.step = step
        self.unit = unit
        self.output = Path(output)
        self.total = total
        self.resumed = resumed
        self.written = 0
        self.requests = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached = 0
        self.dropped: Counter[str] = Counter()
        self.extra: dict = {}
        self.started = time.monotonic()
        self.bar = tqdm(total=total, initial=resumed, desc=step, unit=unit, dynamic_ncols=True, file=sys.stderr)

    def __enter__(self) -> StepStats:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()  # a step that stops on an error leaves no half-drawn bar before its message

    def advance(self, records: int = 1) -> None:
        self.bar.update(records)

    def count_answers(self, answers) -> None:
        """Count one request's answers (`trl_longrm.datagen.models.Answer`, all of one request): the prompt once."""
        self.requests += 1
        if answers:
            self.prompt_tokens += answers[0].prompt_tokens or 0
        self.generated_tokens += sum(answer.generated_tokens or 0 for answer in answers)

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] += count

    def summary(self) -> dict:
        return {
            "step": self.step,
            "output": str(self.output),
            "records": self.total,
            "resumed": self.resumed,
            "written": self.written,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "cached_answers": self.cached,
            "dropped": dict(sorted(self.dropped.items())),
            "seconds": round(time.monotonic() - self.started, 1),
            **self.extra,
        }

    def finish(self) -> dict:
        """Close the bar, write `<output>.summary.json`, print the summary in a few lines and return it."""
        self.bar.close()
        summary = self.summary()
        path = self.output.with_name(self.output.name + SUMMARY_SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        dropped = ", ".join(f"{reason} {count}" for reason, count in summary["dropped"].items()) or "none"
        print(
            f"{self.step}: {summary['written']} rows written to {self.output} ({summary['resumed']} of {self.total} "
            f"{self.unit}s done before); {summary['requests']} requests, {summary['prompt_tokens']:,} prompt and "
            f"{summary['generated_tokens']:,} generated tokens, {summary['cached_answers']} answers from the cache; "
            f"dropped: {dropped}; {summary['seconds']} s. Summary: {path}",
            flush=True,
        )
        return summary
