"""The prompts of the data steps: what a responder sees, what a judge sees (the short context, never the
distractors), and the judge's training prompt (the long context), read from a YAML file (`templates/longrm.yaml`
by default: LongRM's released judge format, `[Analysis] ... [Score: N]`).

Example:
```python
>>> prompts = DataPrompts.default()
>>> messages = prompts.judge_messages("faithfulness", context="The key clue.", question="Q?", answer="A.",
...                                   response="A, because ...")
>>> prompts.parse_score("[Analysis] Right. [Score: 9]"), prompts.parse_score("no score")
(9, -1)
```
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import yaml

from trl_longrm.data.errors import DataFormatError
from trl_longrm.datagen.consensus import UNPARSABLE
from trl_longrm.evaluation.templates import POINTWISE_FORMATS


DEFAULT_PROMPTS_PATH = Path(__file__).resolve().parent / "templates" / "longrm.yaml"

# section -> (keys, placeholders its system may use, placeholders the step fills in its user, those user must use).
# Any other placeholder of a `user` template is filled from the record's own column of that name.
_SECTIONS = {
    "respond": ({"system", "user"}, set(), {"context", "question"}, {"context", "question"}),
    "judge": ({"system", "user"}, set(), {"context", "question", "answer", "response"}, {"context", "response"}),
    "train": ({"system", "user"}, {"focus"}, {"context", "question", "response"}, {"context", "response"}),
}


def _fields(path: Path, key: str, text: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as error:
        raise DataFormatError(
            f"not a valid template ({error}; write a literal brace as {{{{)", source=str(path), key=key
        ) from None


@dataclass(frozen=True)
class DataPrompts:
    """The prompts of `respond`, `judge` and `train`, and the `focus` sentence of a tagged record (see the YAML)."""

    respond_system: str
    respond_user: str
    judge_system: dict[str, str]
    judge_user: str
    train_system: dict[str, str]
    train_user: str
    focus: str
    source: str
    verdict: str = "[Score: N]"

    @classmethod
    def default(cls) -> DataPrompts:
        return cls.from_yaml(DEFAULT_PROMPTS_PATH)

    @classmethod
    def from_yaml(cls, path: str | Path | None) -> DataPrompts:
        """Read and check a prompts file (None: the default); every problem is a `DataFormatError` naming the file
        and the key. A file may give only the sections it changes."""
        if path is None:
            path = DEFAULT_PROMPTS_PATH
        path = Path(path)
        if not path.is_file():
            raise DataFormatError(f"no such file (resolved against {Path.cwd()})", source=str(path))
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, yaml.YAMLError) as error:
            raise DataFormatError(f"not a readable YAML file ({error})", source=str(path)) from None
        if not isinstance(raw, dict):
            raise DataFormatError(
                "expected a mapping with the sections respond, judge, train, focus", source=str(path)
            )
        unknown = sorted(set(raw) - {*_SECTIONS, "focus", "verdict"})
        if unknown:
            raise DataFormatError(
                f"unknown section(s) {unknown}; expected {[*_SECTIONS, 'focus', 'verdict']}", source=str(path)
            )
        base = None if path == DEFAULT_PROMPTS_PATH else cls.default()
        values = {"source": str(path)}
        for name, (keys, system_fields, _, required) in _SECTIONS.items():
            if name not in raw:
                if base is None:
                    raise DataFormatError(f"section `{name}` is missing", source=str(path))
                values[f"{name}_system"] = getattr(base, f"{name}_system")
                values[f"{name}_user"] = getattr(base, f"{name}_user")
                continue
            section = raw[name]
            if not isinstance(section, dict) or set(section) - keys or "user" not in section:
                raise DataFormatError("must be a mapping with `user` (and `system`)", source=str(path), key=name)
            user = section["user"]
            if not isinstance(user, str):
                raise DataFormatError("must be a string", source=str(path), key=f"{name}.user")
            found = _fields(path, f"{name}.user", user)
            if required - found:
                raise DataFormatError(f"must use {sorted(required)}", source=str(path), key=f"{name}.user")
            system = section.get("system", "" if name == "respond" else None)
            if name == "respond":
                if not isinstance(system, str) or _fields(path, f"{name}.system", system):
                    raise DataFormatError(
                        "must be a string without placeholders", source=str(path), key=f"{name}.system"
                    )
            else:
                if not isinstance(system, dict) or not system or not all(isinstance(v, str) for v in system.values()):
                    raise DataFormatError(
                        "must map each perspective (e.g. faithfulness) to its rubric",
                        source=str(path),
                        key=f"{name}.system",
                    )
                for perspective, text in system.items():
                    extra = _fields(path, f"{name}.system.{perspective}", text) - system_fields
                    if extra:
                        raise DataFormatError(
                            f"uses {sorted(extra)}; it may use {sorted(system_fields)}",
                            source=str(path),
                            key=f"{name}.system.{perspective}",
                        )
            values[f"{name}_system"] = system
            values[f"{name}_user"] = user
        focus = raw.get("focus", base.focus if base is not None else "")
        if not isinstance(focus, str) or _fields(path, "focus", focus) - {"tag"}:
            raise DataFormatError("must be a string that may use {tag}", source=str(path), key="focus")
        values["focus"] = focus
        verdict = raw.get("verdict", base.verdict if base is not None else "[Score: N]")
        if verdict not in POINTWISE_FORMATS:
            raise DataFormatError(
                f"is {verdict!r}; supported: {list(POINTWISE_FORMATS)}", source=str(path), key="verdict"
            )
        values["verdict"] = verdict
        missing = sorted(set(values["judge_system"]) ^ set(values["train_system"]))
        if missing:
            raise DataFormatError(
                f"perspective(s) {missing} have a rubric in one of `judge.system` and `train.system` only",
                source=str(path),
            )
        return cls(**values)

    @property
    def perspectives(self) -> list[str]:
        return list(self.judge_system)

    @property
    def score_format(self):
        """How a judgment states its score (`verdict`: LongRM's `[Score: N]` on 0..10 by default, or `[[N]]` on 0..9)."""
        return POINTWISE_FORMATS[self.verdict]

    def record_fields(self, section: str) -> set[str]:
        """The placeholders of `section`'s user template that a record's own columns fill."""
        template = getattr(self, f"{section}_user")
        return _fields(Path(self.source), f"{section}.user", template) - _SECTIONS[section][2]

    def check_record(self, section: str, where, record: dict) -> None:
        """Raise a `DataFormatError` naming the record (`where`, a `Location`) if it lacks a column `section`'s prompt
        uses."""
        for name in sorted(self.record_fields(section)):
            if record.get(name) is None:
                raise where.error(
                    f"the {section} prompt of {self.source} uses {{{name}}}, which the record lacks", key=name
                )

    def _user(self, section: str, record: dict | None, **values) -> str:
        extra = {name: (record or {})[name] for name in self.record_fields(section)}
        return getattr(self, f"{section}_user").format(**extra, **values)

    def respond_messages(self, context: str, question: str, record: dict | None = None) -> list[dict[str, str]]:
        user = {"role": "user", "content": self._user("respond", record, context=context, question=question)}
        return ([{"role": "system", "content": self.respond_system}] if self.respond_system else []) + [user]

    def judge_messages(
        self, perspective: str, context: str, question: str, answer: str, response: str, record: dict | None = None
    ) -> list[dict]:
        """What a judge sees: the rubric, the short context, the question, the golden answer and the response."""
        user = self._user("judge", record, context=context, question=question, answer=answer, response=response)
        return [{"role": "system", "content": self.judge_system[perspective]}, {"role": "user", "content": user}]

    def train_messages(
        self, perspective: str, context: str, question: str, response: str, tag: str | None, record: dict | None = None
    ) -> list[dict]:
        """The judge's training prompt: the rubric (with the tag's sentence), the long context, question, response."""
        focus = self.focus.format(tag=tag) if tag else ""
        system = self.train_system[perspective].format(focus=focus)
        user = self._user("train", record, context=context, question=question, response=response)
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def parse_score(self, text: str) -> int:
        """The judgment's score (the last verdict of `verdict`'s format, on its scale), or `UNPARSABLE` (-1)."""
        score = self.score_format.parse(text)
        return UNPARSABLE if score is None else score
