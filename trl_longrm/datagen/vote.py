"""`vote`: the judged records of `judge` into training rows by consistency majority voting (LongRM section 4.3), with
the rules of `trl_longrm.datagen.consensus` (LongRM's released ones by default). What was dropped, and why, is counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from trl_longrm.datagen.consensus import DROP_NO_REJECTED, VoteRules, vote_scores


@dataclass
class VoteConfig:
    """Settings of the `vote` step (each field is a `--kebab-case` flag of `trl-longrm data vote`): the judged
    records of `judge` into SFT rows (`chat_template` + `golden`), SimPO rows (`chat_template`, `chosen`, `rejects`,
    `scores`, `conf`, `chosen_model`, `reject_models`) and DisRM rows (the same rows: LongRM's DisRM trains on the
    judgments, appendix F), each training prompt holding the long context. The rules are `VoteRules`' (LongRM's
    released ones by default, with `judge_priority` the judges' order in the records).

    Example:
    ```python
    >>> summary = vote(VoteConfig(input="judged.jsonl", sft_output="sft.jsonl", simpo_output="simpo.jsonl"))
    ```
    """

    input: str = field(metadata={"help": "Records of `judge` (`responses`, `judgments`, `long_context`, ...)."})
    sft_output: str | None = field(default=None, metadata={"help": "SFT rows (LongRM stage I format), JSON Lines."})
    simpo_output: str | None = field(
        default=None, metadata={"help": "SimPO rows (LongRM stage II format), JSON Lines."}
    )
    disrm_output: str | None = field(default=None, metadata={"help": "DisRM rows (the SimPO rows), JSON Lines."})
    disrm_max_rows: int | None = field(
        default=None, metadata={"help": "Keep the first this many DisRM rows (LongRM's script: 6000). Default all."}
    )
    judge_priority: list[str] | None = field(
        default=None,
        metadata={
            "help": "Judges in the order their judgment is chosen inside the consensus. Default None: the order of "
            "the judges in the records (the `judge` step's `judges`)."
        },
    )
    reject_order: list[str] | None = field(
        default=None, metadata={"help": "Order of the rejected judgments in each part. Default `judge_priority`."}
    )
    min_agreement: int = field(
        default=2, metadata={"help": VoteRules.__dataclass_fields__["min_agreement"].metadata["help"]}
    )
    tolerance: int = field(default=0, metadata={"help": VoteRules.__dataclass_fields__["tolerance"].metadata["help"]})
    on_tie: str = field(default="drop", metadata={"help": VoteRules.__dataclass_fields__["on_tie"].metadata["help"]})
    disagreeing_first: bool = field(
        default=True, metadata={"help": VoteRules.__dataclass_fields__["disagreeing_first"].metadata["help"]}
    )
    rejected: str = field(
        default="all", metadata={"help": VoteRules.__dataclass_fields__["rejected"].metadata["help"]}
    )
    prompts: str | None = field(default=None, metadata={"help": "Prompts file (default: templates/longrm.yaml)."})

    def __post_init__(self):
        if not (self.sft_output or self.simpo_output or self.disrm_output):
            raise ValueError("vote: give at least one of `sft_output`, `simpo_output`, `disrm_output`.")

    def rules(self, judges: list[str]) -> VoteRules:
        return VoteRules(
            judge_priority=tuple(self.judge_priority or judges),
            reject_order=tuple(self.reject_order) if self.reject_order else None,
            min_agreement=self.min_agreement,
            tolerance=self.tolerance,
            on_tie=self.on_tie,
            disagreeing_first=self.disagreeing_first,
            rejected=self.rejected,
        )


def vote(config: VoteConfig) -> dict:
    """Run the `vote` step: every response of `config.input` voted, the rows written (each output whole, at once);
    returns the summary with the responses dropped by reason."""
    from trl_longrm.datagen.prompts import DataPrompts
    from trl_longrm.datagen.records import RecordSource, record_id, write_jsonl
    from trl_longrm.datagen.summary import StepStats

    source = RecordSource(config.input, required=("responses", "judgments", "long_context", "question"))
    source.check()
    prompts = DataPrompts.from_yaml(config.prompts)
    rules = None
    sft, simpo = [], []
    output = config.simpo_output or config.sft_output or config.disrm_output
    responses = sum(len(record["responses"]) for _, record in source)
    with StepStats("vote", output, responses, unit="response") as stats:
        for where, record in source:
            rid = record_id(where, record)
            well_formed = isinstance(record["judgments"], list) and all(
                isinstance(js, list) and all(isinstance(j, dict) and {"judge", "text", "score"} <= set(j) for j in js)
                for js in record["judgments"]
            )
            if not well_formed:
                raise where.error(
                    "must hold, per response, a list of {judge, text, score} (the `judge` step's)", key="judgments"
                )
            if len(record["judgments"]) != len(record["responses"]):
                raise where.error(
                    f"{len(record['judgments'])} judgment lists for {len(record['responses'])} responses",
                    key="judgments",
                )
            perspective = record.get("perspective") or "faithfulness"
            prompts.check_record("train", where, record)
            if perspective not in prompts.perspectives:
                raise where.error(f"perspective {perspective!r} has no rubric in {prompts.source}", key="perspective")
            for index, (response, judgments) in enumerate(zip(record["responses"], record["judgments"], strict=True)):
                stats.advance()
                texts = {j["judge"]: j["text"] for j in judgments}
                scores = {j["judge"]: int(j["score"]) for j in judgments}
                if rules is None:
                    rules = config.rules([j["judge"] for j in judgments])
                try:
                    verdict = vote_scores(scores, rules)
                except ValueError as error:
                    raise where.error(f"response {index}: {error}", key="judgments") from None
                if verdict.dropped:
                    stats.drop(verdict.dropped)
                    continue
                messages = prompts.train_messages(
                    perspective,
                    record["long_context"],
                    record["question"],
                    response["text"],
                    record.get("tag"),
                    record,
                )
                provenance = {
                    "source_id": record.get("source_id", rid),
                    "response_model": response.get("model"),
                    "perspective": perspective,
                    "target_tokens": record.get("target_tokens"),
                    "context_tokens": record.get("context_tokens"),
                    "insert_index": record.get("insert_index"),
                    "consensus_score": verdict.consensus,
                }
                row_id = f"{rid}/{response.get('id', index)}"
                sft.append({"id": row_id, "chat_template": messages, "golden": texts[verdict.chosen],
                            "chosen_model": verdict.chosen, **provenance})  # fmt: skip
                # A rejected judgment with the chosen one's very text (or an earlier rejected one's) rejects nothing.
                seen, rejected = {texts[verdict.chosen]}, []
                for judge in verdict.rejected:
                    if texts[judge] in seen:
                        stats.extra["identical_rejects_removed"] = stats.extra.get("identical_rejects_removed", 0) + 1
                        continue
                    seen.add(texts[judge])
                    rejected.append(judge)
                if not rejected:
                    stats.drop(DROP_NO_REJECTED + "_preference_row")
                    continue
                simpo.append({
                    "id": row_id, "chat_template": messages, "chosen": texts[verdict.chosen],
                    "rejects": [texts[judge] for judge in rejected], "scores": scores, "conf": verdict.conf,
                    "chosen_model": verdict.chosen, "reject_models": rejected, **provenance,
                })  # fmt: skip
        written = {}
        if config.sft_output:
            written["sft_rows"] = write_jsonl(config.sft_output, sft)
        if config.simpo_output:
            written["simpo_rows"] = write_jsonl(config.simpo_output, simpo)
        if config.disrm_output:
            written["disrm_rows"] = write_jsonl(config.disrm_output, simpo[: config.disrm_max_rows])
        stats.written = len(simpo) if config.simpo_output or config.disrm_output else len(sft)
        stats.extra.update(written)
        stats.extra["rules"] = asdict(rules) if rules is not None else None
        return stats.finish()
