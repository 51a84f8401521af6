"""Judge prompt templates: the system and user messages of each judging protocol, and the verdict each expects.

The built-in prompts are themselves such a file (`templates/default.yaml`); `--prompt-template FILE` replaces them,
so that a checkpoint is evaluated with the prompts it was trained with. A file is checked as a whole when it is read:
an unknown section, key, placeholder or verdict format is an error naming the file and the key.

Example:
```python
>>> template = PromptTemplate.from_yaml("my_judge_prompts.yaml")
>>> system, user = template.pairwise_messages("Summarise the report.", ["first answer", "second answer"])
>>> template.pointwise_format.parse("[Analysis] Faithful. [Score: 8]")
8
```
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path

import yaml

from trl_longrm.data.errors import DataFormatError


DEFAULT_TEMPLATE_PATH = Path(__file__).resolve().parent / "templates" / "default.yaml"


def label(position: int) -> str:
    """Letter naming the response at a display position (0 -> `A`)."""
    return chr(ord("A") + position)


@dataclass(frozen=True)
class PointwiseFormat:
    """How a pointwise judgment states its score: the text that opens the verdict (`prefix`, where the forced-decoding
    probe reads the score-token probabilities), the pattern of the whole verdict and the score scale."""

    name: str
    prefix: str
    pattern: str
    scale: tuple[int, int]

    def parse(self, text: str) -> int | None:
        """The score of the last verdict in `text`, or None when there is none or it is off the scale."""
        matches = re.findall(self.pattern, text)
        if not matches:
            return None
        score = int(matches[-1])
        low, high = self.scale
        return score if low <= score <= high else None


POINTWISE_FORMATS = {
    "[[N]]": PointwiseFormat("[[N]]", "[[", r"\[\[\s*(\d+)\s*\]\]", (0, 9)),
    # LongRM's released judge data ends each judgment with `[Score: N]`, N from 0 to 10.
    "[Score: N]": PointwiseFormat("[Score: N]", "[Score: ", r"\[Score:\s*(\d+)\s*\]", (0, 10)),
}
# Section -> (verdict formats it may declare, placeholders its templates may use, placeholders `user` must use).
_SECTIONS = {
    "pairwise": (("[[A]]",), {"task", "responses", "label", "response"}, {"task", "responses"}),
    "ranking": (
        ("[[A>B]]",),
        {"task", "responses", "label", "response", "n", "labels", "example", "pattern"},
        {"task", "responses"},
    ),
    "pointwise": (tuple(POINTWISE_FORMATS), {"task", "response", "low", "high", "example"}, {"task", "response"}),
}
_KEYS = {"system", "user", "response", "separator", "verdict"}


@dataclass(frozen=True)
class JudgePrompt:
    """One protocol's templates: `system`, `user`, the `response` block of each displayed response (pairwise and
    ranking) joined by `separator`, and the `verdict` format."""

    system: str
    user: str
    verdict: str
    response: str | None = None
    separator: str = "\n\n"


@dataclass(frozen=True)
class PromptTemplate:
    """The judge prompts of the three protocols (pairwise, ranking, pointwise), read from a YAML file.

    Example:
    ```python
    >>> template = PromptTemplate.default()
    >>> [m["role"] for m in template.pairwise_messages("What is 2+2?", ["4", "5"])]
    ['system', 'user']
    ```
    """

    pairwise: JudgePrompt
    ranking: JudgePrompt
    pointwise: JudgePrompt
    source: str

    @classmethod
    def default(cls) -> PromptTemplate:
        """The built-in prompts (`templates/default.yaml`)."""
        return cls.from_yaml(DEFAULT_TEMPLATE_PATH)

    @classmethod
    def from_yaml(cls, path: str | Path) -> PromptTemplate:
        """Read and check a template file; every problem is a `DataFormatError` (a `ValueError`) naming the file and
        the key."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Prompt template {path} not found (resolved from {Path.cwd()}).")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise DataFormatError(f"{path}: not UTF-8 text (byte {error.start + 1} of the file).") from None
        except yaml.YAMLError as error:
            raise DataFormatError(f"{path}: not valid YAML ({error}).") from error
        if not isinstance(raw, dict):
            raise DataFormatError(f"{path}: expected a mapping with the sections {sorted(_SECTIONS)}.")
        unknown = sorted(set(raw) - set(_SECTIONS))
        if unknown:
            raise DataFormatError(f"{path}: unknown section(s) {unknown}; expected {sorted(_SECTIONS)}.")
        default = None if path == DEFAULT_TEMPLATE_PATH else cls.default()
        sections = {}
        for name in _SECTIONS:
            if name not in raw:
                if default is None:
                    raise DataFormatError(f"{path}: section `{name}` is missing.")
                # A file may give only the protocols it changes; the others keep the built-in prompts.
                sections[name] = getattr(default, name)
                continue
            sections[name] = _read_section(path, name, raw[name])
        return cls(**sections, source=str(path))

    @property
    def pointwise_format(self) -> PointwiseFormat:
        return POINTWISE_FORMATS[self.pointwise.verdict]

    def pairwise_messages(self, task_prompt: str, responses: list[str]) -> list[dict[str, str]]:
        """System and user messages asking to pick the better of two responses (labelled A and B)."""
        if len(responses) != 2:
            raise ValueError(f"A pairwise judgment needs exactly 2 responses, got {len(responses)}.")
        return self._messages(self.pairwise, task=task_prompt, responses=self._blocks(self.pairwise, responses))

    def ranking_messages(self, task_prompt: str, responses: list[str]) -> list[dict[str, str]]:
        """System and user messages asking to rank the responses (labelled A, B, ...), best first."""
        if len(responses) < 2:
            raise ValueError(f"A judge needs at least 2 responses, got {len(responses)}.")
        labels = [label(i) for i in range(len(responses))]
        return self._messages(
            self.ranking,
            task=task_prompt,
            responses=self._blocks(self.ranking, responses),
            n=len(responses),
            labels=", ".join(labels),
            example="[[" + ">".join(labels[::-1]) + "]]",
            pattern="[[" + ">".join(labels) + "]]",  # LongRM's own prompt shows the format in display order
        )

    def pointwise_messages(self, task_prompt: str, response: str) -> list[dict[str, str]]:
        """System and user messages asking to score a single response on the verdict's scale."""
        low, high = self.pointwise_format.scale
        return self._messages(self.pointwise, task=task_prompt, response=response, low=low, high=high, example=high - 2)

    @staticmethod
    def _blocks(prompt: JudgePrompt, responses: list[str]) -> str:
        blocks = [prompt.response.format(label=label(i), response=r) for i, r in enumerate(responses)]
        return prompt.separator.join(blocks)

    @staticmethod
    def _messages(prompt: JudgePrompt, **values) -> list[dict[str, str]]:
        # Each template uses a subset of the values (checked when the file was read).
        return [
            {"role": "system", "content": prompt.system.format(**values)},
            {"role": "user", "content": prompt.user.format(**values)},
        ]


def _placeholders(path: Path, key: str, text: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as error:
        raise DataFormatError(
            f"{path}: key `{key}` is not a valid template ({error}; write a literal brace as {{{{)."
        ) from error


def _read_section(path: Path, name: str, raw) -> JudgePrompt:
    formats, allowed, required = _SECTIONS[name]
    if not isinstance(raw, dict):
        raise DataFormatError(f"{path}: section `{name}` must be a mapping of {sorted(_KEYS)}.")
    keys = _KEYS - ({"response", "separator"} if name == "pointwise" else set())
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise DataFormatError(f"{path}: key(s) {[f'{name}.{k}' for k in unknown]} unknown; expected {sorted(keys)}.")
    needed = {"system", "user", "verdict"} | ({"response"} if name != "pointwise" else set())
    for key in sorted(needed):
        if key not in raw:
            raise DataFormatError(f"{path}: key `{name}.{key}` is missing.")
    for key, value in raw.items():
        if not isinstance(value, str):
            raise DataFormatError(f"{path}: key `{name}.{key}` must be a string, got {type(value).__name__}.")
    if raw["verdict"] not in formats:
        raise DataFormatError(f"{path}: key `{name}.verdict` is {raw['verdict']!r}; supported: {list(formats)}.")
    message_fields = allowed - {"label", "response"} if name != "pointwise" else allowed
    for key in ("system", "user"):
        unknown = _placeholders(path, f"{name}.{key}", raw[key]) - message_fields
        if unknown:
            raise DataFormatError(
                f"{path}: key `{name}.{key}` uses unknown placeholder(s) {sorted(unknown)}; "
                f"available: {sorted(message_fields)}."
            )
    missing = required - _placeholders(path, f"{name}.user", raw["user"])
    if missing:
        raise DataFormatError(f"{path}: key `{name}.user` must contain the placeholder(s) {sorted(missing)}.")
    if name != "pointwise":
        unknown = _placeholders(path, f"{name}.response", raw["response"]) - {"label", "response"}
        if unknown:
            raise DataFormatError(
                f"{path}: key `{name}.response` uses unknown placeholder(s) {sorted(unknown)}; available: "
                "['label', 'response']."
            )
        if "response" not in _placeholders(path, f"{name}.response", raw["response"]):
            raise DataFormatError(f"{path}: key `{name}.response` must contain the placeholder ['response'].")
    return JudgePrompt(
        system=raw["system"],
        user=raw["user"],
        verdict=raw["verdict"],
        response=raw.get("response"),
        separator=raw.get("separator", "\n\n"),
    )
