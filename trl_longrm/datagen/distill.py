"""`distill`: best-of-N self-distillation (LongRM section 6.2, appendix G). For each prompt, `num_rollouts` rollouts
of a policy are scored by a trained reward model and the best one becomes an SFT target (`LongSFTTrainer` rows).

The scorer is a trained DisRM (its score; transformers, in-process vLLM or a vLLM server's `/classify`) or a generative
judge (pointwise: each rollout's score; pairwise: two rollouts shown in a shuffled order, or a ranking of more), built
by the evaluation's own machinery (`trl_longrm.evaluation.runner.build_judge`) from `scorer`, a mapping of
`EvalConfig` fields (`model_path`, `backend`, `base_url`, `judge_protocol`, `max_length`, ...). A record whose
rollouts the scorer cannot order (a judgment without a score or verdict) is dropped and counted.

Input: records with `prompt` (a text or messages), `chat_template` or `messages` (messages; a final assistant turn
is dropped). A `prompt` whose messages end with an assistant turn is a prefilled answer, as TRL reads such a prompt:
the policy continues that turn (`continue_final_message`), the scorer sees the whole answer (the prefill and the
rollout) and the SFT row holds it as one assistant turn. Output: `messages` (the prompt and the kept rollout) or
`prompt` + `completion`, with `rollouts` (each the whole answer), their `scores` (None for a pairwise judge) and
`kept` (the kept rollout's index).

Example:
```python
>>> distill(DistillConfig(input="prompts.jsonl", output="distilled.jsonl", num_rollouts=2,
...                       policy={"name": "policy", "backend": "vllm", "model": "./Qwen3-8B"},
...                       scorer={"model_path": "./LongRM-DisRM", "backend": "vllm"}))
```
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl_longrm.data.errors import RunConfigError
from trl_longrm.datagen.models import ModelSpec, build_chat_model, continues
from trl_longrm.datagen.records import RecordSource, ResumableWriter
from trl_longrm.datagen.steps import request_seed, rounds
from trl_longrm.datagen.summary import StepStats
from trl_longrm.serving.sampling import Sampling


@dataclass
class DistillConfig:
    """Settings of `distill` (the `trl-longrm data distill` flags; `policy` and `scorer` take a YAML mapping).

    Example:
    ```python
    >>> config = DistillConfig(input="prompts.jsonl", output="sft.jsonl", policy={"name": "p", "model": "./policy"},
    ...                        scorer={"model_path": "./disrm"})
    ```
    """

    input: str = field(metadata={"help": "Prompts: `prompt` (text or messages), `chat_template` or `messages`."})
    output: str = field(metadata={"help": "Output JSON Lines file of SFT rows (resumable)."})
    policy: dict | ModelSpec = field(
        default_factory=dict, metadata={"help": "The policy: a mapping of `ModelSpec` (name, backend, model, ...)."}
    )
    scorer: dict = field(
        default_factory=dict,
        metadata={
            "help": "The reward model: a mapping of `EvalConfig` fields, `model_path` at least (a DisRM is detected from "
            "its head; a judge is pointwise unless `judge_protocol: pairwise`)."
        },
    )
    num_rollouts: int = field(default=2, metadata={"help": "Rollouts per prompt (the paper: 2). Default 2."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the rollouts. Default 1.0."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling's mass. Default 1.0."})
    max_new_tokens: int = field(default=1024, metadata={"help": "Most tokens of a rollout. Default 1024."})
    seed: int = field(default=0, metadata={"help": "Seed of the rollouts and display orders. Default 0."})
    batch_size: int = field(default=8, metadata={"help": "Prompts whose requests go out together. Default 8."})

    def __post_init__(self):
        self.policy = ModelSpec.from_dict(self.policy, "distill: policy")
        if not isinstance(self.scorer, dict):
            raise RunConfigError("distill: `scorer` must be a mapping of EvalConfig's fields, `model_path` at least")
        if self.num_rollouts < 2:
            raise RunConfigError(
                f"distill: `num_rollouts` must be >= 2 (one best of several), got {self.num_rollouts}"
            )
        Sampling(n=self.num_rollouts, temperature=self.temperature, top_p=self.top_p)

    def eval_config(self):
        """The scorer's `EvalConfig` (its fields checked as `trl-longrm eval` checks them)."""
        from trl_longrm.evaluation.config import EvalConfig
        from trl_longrm.evaluation.score import _detect_disrm

        if not self.scorer.get("model_path"):
            raise RunConfigError("distill: `scorer` must be a mapping of EvalConfig's fields, `model_path` at least")
        known = {f.name for f in dataclasses.fields(EvalConfig)} - {"data_path", "save_path", "tasks", "formats"}
        unknown = sorted(set(self.scorer) - known)
        if unknown:
            raise RunConfigError(f"distill: scorer: unknown key(s) {unknown}; expected EvalConfig's {sorted(known)}")
        values = dict(self.scorer)
        values.setdefault("judge_protocol", "pointwise")
        if values.get("is_disrm") is None:
            if not Path(values["model_path"]).exists():
                raise RunConfigError(
                    f"distill: scorer: {values['model_path']} is not here to tell a DisRM from a judge: set `is_disrm`"
                )
            values["is_disrm"] = _detect_disrm(values["model_path"])
        try:
            return EvalConfig(data_path=self.input, **values)
        except (TypeError, ValueError) as error:
            raise RunConfigError(f"distill: scorer: {error}") from None


def prompt_of(where, record) -> list[dict] | str:
    for key in ("prompt", "chat_template", "messages"):
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, str) and value.strip():
            return value
        if (
            isinstance(value, list)
            and value
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
        ):
            messages = [{"role": m["role"], "content": m["content"]} for m in value]
            if messages[-1]["role"] == "assistant" and (key != "prompt" or len(messages) == 1):
                messages = messages[:-1]
            if messages:
                return messages
        raise where.error("must be a text or a list of {role, content} messages", key=key)
    raise where.error("a prompt needs `prompt`, `chat_template` or `messages`", key="prompt")


def best_rollout(output, order: list[int], score_format=None) -> tuple[int | None, list[float] | None]:
    """The index of the best rollout (in rollout order) from a judge's output on the rollouts shown in `order`, and
    the rollouts' scores where the judge gives scores; None where it cannot be read. `score_format` reads a pointwise
    judge's judgments (its template's `pointwise_format`) where it gave no expected scores."""
    from trl_longrm.evaluation.prompts import parse_pairwise_verdict, parse_ranking_verdict

    n = len(order)
    shown_scores = output.scores
    if output.judgments is not None and shown_scores is None:
        parsed = [score_format.parse(text) for text in output.judgments]
        shown_scores = None if None in parsed else parsed
    if shown_scores is not None:
        scores = [0.0] * n
        for position, index in enumerate(order):
            scores[index] = float(shown_scores[position])
        return max(range(n), key=lambda i: (scores[i], -i)), scores
    if output.text is None:
        return None, None
    ranks = parse_pairwise_verdict(output.text) if n == 2 else parse_ranking_verdict(output.text, n)
    if ranks is None:
        return None, None
    return order[ranks.index(0)], None


def distill(config: DistillConfig, judge=None) -> dict:
    """Run `distill` on every prompt of `config.input` not in `config.output` yet; returns the summary. `judge`
    replaces the scorer built from `config.scorer` (a `trl_longrm.evaluation.Judge`)."""
    from trl_longrm.evaluation.judges import JudgeRequest
    from trl_longrm.evaluation.prompts import shuffled_order
    from trl_longrm.evaluation.runner import build_judge
    from trl_longrm.evaluation.templates import PromptTemplate

    source = RecordSource(config.input)
    total = source.check()
    for where, record in source:  # every prompt readable, before any model loads
        prompt_of(where, record)
    eval_config = config.eval_config() if judge is None else None
    protocol = eval_config.judge_protocol if eval_config is not None else getattr(judge, "protocol", "pointwise")
    identity = {key: value for key, value in asdict(config).items() if key not in ("output", "batch_size")}
    identity["policy"] = config.policy.identity()
    with (
        ResumableWriter(config.output, identity) as writer,
        StepStats("distill", config.output, total, resumed=len(writer.done)) as stats,
    ):
        policy = None
        for batch in rounds(source, writer.done, config.batch_size):
            if policy is None:
                policy = build_chat_model(config.policy)
                if judge is None:
                    template = (
                        PromptTemplate.from_yaml(eval_config.prompt_template)
                        if eval_config.prompt_template
                        else PromptTemplate.default()
                    )
                    judge = build_judge(eval_config, template, eval_config.device)
            prompts = [prompt_of(where, record) for where, _, record in batch]
            conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
            samplings = [Sampling(n=config.num_rollouts, temperature=config.temperature, top_p=config.top_p,
                                  seed=request_seed(config.seed, rid)) for _, rid, _ in batch]  # fmt: skip
            groups = policy.answer(conversations, config.max_new_tokens, samplings)
            # A prefilled answer: the scorer and the SFT row see it whole, after the prompt without it.
            prefills = [p[-1]["content"] if not isinstance(p, str) and continues(p) else "" for p in prompts]
            prompts = [p[:-1] if not isinstance(p, str) and continues(p) else p for p in prompts]
            requests, orders, all_rollouts = [], [], []
            pairwise = judge.model_type == "GRM" and protocol == "pairwise"
            for (_, rid, _), prompt, group, prefill in zip(batch, prompts, groups, prefills, strict=True):
                stats.count_answers(group)
                rollouts = [prefill + answer.text for answer in group]
                all_rollouts.append(rollouts)
                order = shuffled_order(config.seed, rid, len(rollouts)) if pairwise else list(range(len(rollouts)))
                text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
                messages = prompt if judge.model_type == "DisRM" else []
                if judge.model_type == "DisRM" and isinstance(prompt, str):
                    messages = [{"role": "user", "content": prompt}]
                requests.append(JudgeRequest(rid, messages, text, [rollouts[i] for i in order],
                                             ranking=pairwise and len(rollouts) > 2))  # fmt: skip
                orders.append(order)
            outputs = judge.judge(requests)
            for (_, rid, _), prompt, rollouts, order, out in zip(
                batch, prompts, all_rollouts, orders, outputs, strict=True
            ):
                kept, scores = best_rollout(
                    out, order, getattr(getattr(judge, "template", None), "pointwise_format", None)
                )
                stats.advance()
                if kept is None:
                    stats.drop("unscored")
                    writer.drop(rid, "unscored")
                    continue
                row = {"id": rid}
                if isinstance(prompt, str):
                    row.update(prompt=prompt, completion=rollouts[kept])
                else:
                    row["messages"] = [*prompt, {"role": "assistant", "content": rollouts[kept]}]
                writer.write({**row, "rollouts": rollouts, "scores": scores, "kept": kept})
                stats.written += 1
        return stats.finish()
