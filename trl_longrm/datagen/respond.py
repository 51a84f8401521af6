"""`respond`: responses to each long prompt, sampled from one or more models (LongRM section 4.2: weaker models answer
the long prompt, with perturbations for a spread of quality).

Each model writes `num_responses` responses per record (one count, or one per model). Each response is given a perturbation, drawn with the
`perturbations` weights: `none` (the long context as it is), `clue_dropout` (each critical chunk removed from it with
probability `clue_dropout`, at least one) or `truncate` (only its first `truncate_keep` share). The responses of one
model with the same perturbation are one request with `n` samples (the prompt prefilled once); each request has its
own seed. Output: each record with `responses`, a list of `{id, model, perturbation, text}`; empty answers are
dropped and counted.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict, dataclass, field

from trl_longrm.data.errors import RunConfigError
from trl_longrm.datagen.models import build_chat_model
from trl_longrm.datagen.prompts import DataPrompts
from trl_longrm.datagen.records import RecordSource, ResumableWriter
from trl_longrm.datagen.steps import model_specs, request_seed, rounds
from trl_longrm.datagen.summary import StepStats
from trl_longrm.serving.sampling import Sampling


PERTURBATIONS = ("none", "clue_dropout", "truncate")


@dataclass
class RespondConfig:
    """Settings of `respond` (each field is a `--kebab-case` flag of `trl-longrm data respond`; `models` takes one
    YAML mapping per model, e.g. `--models "{name: small, backend: vllm, model: ./Qwen3-0.6B}"`).

    Example:
    ```python
    >>> config = RespondConfig(input="long.jsonl", output="responses.jsonl", num_responses=2,
    ...                        models=[{"name": "small", "backend": "vllm", "model": "./Qwen3-0.6B"}])
    >>> summary = respond(config)
    ```
    """

    input: str = field(metadata={"help": "Records of `expand` (`long_context`, `question`, `placements`, `id`)."})
    output: str = field(metadata={"help": "Output JSON Lines file (resumable)."})
    models: list = field(
        default_factory=list,
        metadata={"help": "The responders: mappings of `trl_longrm.datagen.models.ModelSpec` (name, backend, ...)."},
    )
    num_responses: int | dict = field(
        default=2,
        metadata={"help": "Responses per record and model, or a mapping of model names to their count. Default 2."},
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0: greedy). Default 1.0."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling's mass. Default 1.0 (off)."})
    max_new_tokens: int = field(default=1024, metadata={"help": "Most tokens of a response. Default 1024."})
    seed: int = field(default=0, metadata={"help": "Seed of the perturbations and requests. Default 0."})
    perturbations: dict = field(
        default_factory=lambda: {"none": 1.0},
        metadata={
            "help": f"Weight of each perturbation ({', '.join(PERTURBATIONS)}) in the draw of a response's. Default "
            "{none: 1.0}; LongRM's spread, e.g. {none: 0.5, clue_dropout: 0.25, truncate: 0.25}."
        },
    )
    perturbation_mix: str = field(
        default="random",
        metadata={
            "help": "How a record's responses get their perturbations: 'random' (each drawn with the weights) or "
            "'proportional' (the weights' shares of a model's responses, rounded, the remainder drawn): every record "
            "then has responses of each kind. Default random.",
            "choices": ["random", "proportional"],
        },
    )
    clue_dropout: float = field(
        default=0.5,
        metadata={"help": "Probability that `clue_dropout` removes each chunk (one at least). Default 0.5."},
    )
    truncate_keep: float = field(
        default=0.5, metadata={"help": "Share of the context `truncate` keeps (its beginning). Default 0.5."}
    )
    prompts: str | None = field(default=None, metadata={"help": "Prompts file (default: templates/longrm.yaml)."})
    batch_size: int = field(
        default=16,
        metadata={"help": "Records whose requests go out together (then their rows are written). Default 16."},
    )

    def __post_init__(self):
        self.models = model_specs(self.models, "respond: models")
        if not isinstance(self.perturbations, dict) or not self.perturbations:
            raise RunConfigError(f"respond: `perturbations` must map some of {list(PERTURBATIONS)} to weights")
        unknown = sorted(set(self.perturbations) - set(PERTURBATIONS))
        if unknown or any(not isinstance(w, (int, float)) or w < 0 for w in self.perturbations.values()):
            raise RunConfigError(
                f"respond: `perturbations` {self.perturbations} must map some of {list(PERTURBATIONS)} to weights >= 0"
            )
        if self.perturbation_mix not in ("random", "proportional"):
            raise RunConfigError(
                f"respond: `perturbation_mix` must be random or proportional, got {self.perturbation_mix!r}"
            )
        if sum(self.perturbations.values()) <= 0:
            raise RunConfigError("respond: the weights of `perturbations` sum to 0")
        for name, low, high in (("clue_dropout", 0, 1), ("truncate_keep", 0, 1)):
            value = getattr(self, name)
            if not low < value <= high:
                raise RunConfigError(f"respond: `{name}` must be in ({low}, {high}], got {value}")
        names = [spec.name for spec in self.models]
        counts = (
            self.num_responses if isinstance(self.num_responses, dict) else dict.fromkeys(names, self.num_responses)
        )
        if sorted(counts) != sorted(names):
            raise RunConfigError(f"respond: `num_responses` names the models {sorted(counts)}; the models are {names}")
        if (
            any(not isinstance(n, int) or n < 1 for n in counts.values())
            or self.batch_size < 1
            or self.max_new_tokens < 1
        ):
            raise RunConfigError("respond: `num_responses`, `batch_size` and `max_new_tokens` must be >= 1")

    def responses_of(self, model: str) -> int:
        """How many responses `model` writes per record."""
        return self.num_responses[model] if isinstance(self.num_responses, dict) else self.num_responses
        Sampling(temperature=self.temperature, top_p=self.top_p)  # checks them


def draw_perturbations(rng: random.Random, kinds: list[str], weights: list[float], count: int, mix: str) -> Counter:
    """How many of `count` responses get each perturbation: drawn one by one with `weights` (`random`), or the
    weights' shares rounded down and the remainder drawn (`proportional`)."""
    if mix == "random":
        return Counter(rng.choices(kinds, weights, k=count))
    total = sum(weights)
    drawn = Counter({kind: int(count * weight / total) for kind, weight in zip(kinds, weights, strict=True)})
    drawn.update(rng.choices(kinds, weights, k=count - sum(drawn.values())))
    return drawn


def perturbed_context(record: dict, kind: str, rng: random.Random, config: RespondConfig) -> str:
    """The long context as a response of perturbation `kind` sees it."""
    context = record["long_context"]
    if kind == "truncate":
        return context[: max(1, int(len(context) * config.truncate_keep))]
    if kind == "clue_dropout":
        spans = [tuple(span) for span in record.get("placements") or []]
        if not spans:
            return context
        dropped = [span for span in spans if rng.random() < config.clue_dropout] or [rng.choice(spans)]
        for start, end in sorted(dropped, reverse=True):
            context = context[:start] + context[end:]
    return context


def respond(config: RespondConfig) -> dict:
    """Run `respond` on every record of `config.input` not in `config.output` yet; returns the summary."""
    source = RecordSource(config.input, required=("id", "long_context", "question"))
    total = source.check()
    prompts = DataPrompts.from_yaml(config.prompts)
    for where, record in source:  # the columns the prompt uses, before any model loads
        prompts.check_record("respond", where, record)
    identity = {key: value for key, value in asdict(config).items() if key not in ("output", "batch_size")}
    identity["models"] = [spec.identity() for spec in config.models]
    kinds = list(config.perturbations)
    weights = [config.perturbations[kind] for kind in kinds]
    with (
        ResumableWriter(config.output, identity) as writer,
        StepStats("respond", config.output, total, resumed=len(writer.done)) as stats,
    ):
        models = None
        for batch in rounds(source, writer.done, config.batch_size):
            models = models or [build_chat_model(spec) for spec in config.models]  # once there is work to do
            responses = {rid: [] for _, rid, _ in batch}
            for model in models:
                requests = []  # (record id, perturbation, count, messages, sampling)
                for _, rid, record in batch:
                    rng = random.Random(request_seed(config.seed, rid, model.name))
                    drawn = draw_perturbations(
                        rng, kinds, weights, config.responses_of(model.name), config.perturbation_mix
                    )
                    for kind in kinds:
                        if drawn[kind]:
                            context = perturbed_context(record, kind, rng, config)
                            messages = prompts.respond_messages(context, record["question"], record)
                            sampling = Sampling(n=drawn[kind], temperature=config.temperature, top_p=config.top_p,
                                                seed=request_seed(config.seed, rid, model.name, kind))  # fmt: skip
                            requests.append((rid, kind, messages, sampling))
                answers = model.answer([r[2] for r in requests], config.max_new_tokens, [r[3] for r in requests])
                for (rid, kind, _, _), group in zip(requests, answers, strict=True):
                    stats.count_answers(group)
                    for answer in group:
                        if not answer.text.strip():
                            stats.drop("empty_response")
                            continue
                        number = len([r for r in responses[rid] if r["model"] == model.name])
                        responses[rid].append(
                            {
                                "id": f"{model.name}/{number}",
                                "model": model.name,
                                "perturbation": kind,
                                "text": answer.text,
                            }
                        )
            for _, rid, record in batch:
                stats.advance()
                if not responses[rid]:
                    stats.drop("no_response")
                    writer.drop(rid, "no_response")
                    continue
                writer.write({**record, "responses": responses[rid]})
                stats.written += 1
        return stats.finish()
