"""The data steps that ask models (`respond`, `judge`, `distill`) and `mix`, on tiny models and scripted judges."""

import random

import pytest
from datagen_helpers import read_jsonl, short_records, strict_judge, write_corpus, write_jsonl

from trl_longrm.data.errors import DataFormatError, RunConfigError
from trl_longrm.datagen.expand import ExpandConfig, expand
from trl_longrm.datagen.judge import JudgeConfig, judge
from trl_longrm.datagen.respond import RespondConfig, perturbed_context, respond
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model


HELPERS = "datagen_helpers"  # the scripted judges, importable in the tests' process


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    tokenizer = build_chat_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    corpus = write_corpus(root / "corpus.jsonl")
    short = write_jsonl(root / "short.jsonl", short_records())
    expand(ExpandConfig(input=short, corpus=corpus, tokenizer=str(root / "tokenizer"), output=str(root / "long.jsonl"),
                        target_lengths=[200, 400]))  # fmt: skip
    return {
        "root": root,
        "long": str(root / "long.jsonl"),
        "policy": save_tiny_model(root / "policy", arch="qwen3", task="causal-lm", seed=2),
        "disrm": save_tiny_model(root / "disrm", arch="llama", task="seq-cls", seed=4),
    }


def _respond(assets, name, **overrides):
    settings = dict(input=assets["long"], output=str(assets["root"] / name), num_responses=3, max_new_tokens=6,
                    models=[{"name": "tiny", "model": assets["policy"]}],
                    perturbations={"none": 1, "clue_dropout": 1, "truncate": 1})  # fmt: skip
    summary = respond(RespondConfig(**{**settings, **overrides}))
    return read_jsonl(assets["root"] / name), summary


def test_respond_samples_each_request_under_its_own_seed(assets):
    rows, summary = _respond(assets, "responses.jsonl")
    assert len(rows) == 6 and summary["written"] == 6
    for row in rows:
        assert [r["id"] for r in row["responses"]] == ["tiny/0", "tiny/1", "tiny/2"]
        assert {r["perturbation"] for r in row["responses"]} <= {"none", "clue_dropout", "truncate"}
    texts = [r["text"] for row in rows for r in row["responses"]]
    assert len(set(texts)) > len(texts) // 2  # sampled, not greedy copies
    assert summary["generated_tokens"] > 0 and summary["prompt_tokens"] > 0
    # Seeds are the requests' own: one record per round gives the same responses as four.
    again, _ = _respond(assets, "responses_one_by_one.jsonl", batch_size=1)
    assert again == rows
    other, _ = _respond(assets, "responses_seed1.jsonl", seed=1)
    assert [r["text"] for row in other for r in row["responses"]] != texts


def test_perturbations_change_the_context():
    record = {"long_context": "aaaa CHUNK1 bbbb CHUNK2 cccc", "placements": [[5, 11], [17, 23]]}
    config = RespondConfig(input="x", output="y", models=[{"name": "m", "backend": "python", "function": "m:f"}],
                           clue_dropout=0.5, truncate_keep=0.5)  # fmt: skip
    for seed in range(20):
        dropped = perturbed_context(record, "clue_dropout", random.Random(seed), config)
        assert dropped.count("CHUNK") in (0, 1) and "aaaa" in dropped and "cccc" in dropped
    assert perturbed_context(record, "truncate", random.Random(0), config) == record["long_context"][:14]
    assert perturbed_context(record, "none", random.Random(0), config) == record["long_context"]


def _judges(*names):
    functions = {
        "strict": "strict_judge",
        "lenient": "lenient_judge",
        "silent": "silent_judge",
        "strict2": "strict_judge",
    }
    return [{"name": name, "backend": "python", "function": f"{HELPERS}:{functions[name]}"} for name in names]


def test_judge_scores_caches_and_never_asks_again(assets):
    _respond(assets, "to_judge.jsonl")
    source = assets["root"] / "to_judge.jsonl"
    # A response that holds the answer, for the judges to tell apart.
    rows = read_jsonl(source)
    rows[0]["responses"][0]["text"] = f"It is {rows[0]['answer']}."
    write_jsonl(source, rows)
    output = assets["root"] / "judged.jsonl"
    summary = judge(JudgeConfig(input=str(source), output=str(output), judges=_judges("strict", "lenient")))
    judged = read_jsonl(output)
    assert summary["requests"] == 2 * sum(len(row["responses"]) for row in rows) and summary["cached_answers"] == 0
    first = judged[0]["judgments"][0]
    assert [(j["judge"], j["score"]) for j in first] == [("strict", 9), ("lenient", 9)]
    for row in judged:
        assert len(row["judgments"]) == len(row["responses"])
        for response, judgments in zip(row["responses"], row["judgments"], strict=True):
            expected = strict_judge([{"role": "user", "content": _judge_user(row, response)}], 1, None)[0]
            assert judgments[0]["text"] == expected
    # The same command on a fresh output, with the same cache: nothing asked again.
    again = judge(JudgeConfig(input=str(source), output=str(assets["root"] / "judged_again.jsonl"),
                              judges=_judges("strict", "lenient"), cache=str(output) + ".cache.jsonl"))  # fmt: skip
    assert again["requests"] == 0 and again["cached_answers"] == summary["requests"]
    assert read_jsonl(assets["root"] / "judged_again.jsonl") == judged


def _judge_user(row, response):
    from trl_longrm.datagen.prompts import DataPrompts

    return DataPrompts.default().judge_messages(row["perspective"], row["short_context"], row["question"],
                                                row["answer"], response["text"])[-1]["content"]  # fmt: skip


def test_a_judge_that_never_scores_stops_the_step_and_keeps_the_answers(assets):
    _respond(assets, "silent_in.jsonl")
    output = assets["root"] / "silent.jsonl"
    config = JudgeConfig(input=str(assets["root"] / "silent_in.jsonl"), output=str(output),
                         judges=_judges("strict", "silent"), max_unparsable=4, batch_size=1)  # fmt: skip
    with pytest.raises(RunConfigError, match=r"judge 'silent' wrote no `\[Score: N\]` .* first 4 answers"):
        judge(config)
    cached = read_jsonl(str(output) + ".cache.jsonl")
    assert len(cached) >= 8  # both judges' answers of the records judged so far
    # With max_unparsable above its answers, the silent judge's judgments score -1.
    judge(JudgeConfig(input=config.input, output=str(output), judges=config.judges, max_unparsable=1000, batch_size=1))
    scores = {
        j["score"] for row in read_jsonl(output) for js in row["judgments"] for j in js if j["judge"] == "silent"
    }
    assert scores == {-1}


def test_a_crashed_judge_resumes_without_asking_twice(assets, tmp_path, monkeypatch):
    """A judge that fails in the middle of a round (a server gone): the answers it gave before are kept, and the same
    command asks only for the others."""
    import datagen_helpers

    rows = [{**row, "responses": [{"id": f"m/{k}", "model": "m", "text": f"answer {k} of {row['id']}"} for k in range(3)]}
            for row in read_jsonl(assets["long"])]  # fmt: skip
    write_jsonl(assets["root"] / "crash_in.jsonl", rows)
    calls = {"n": 0}

    def flaky(messages, n, seed):
        calls["n"] += 1
        if calls["n"] == 8:  # a request of the third record, not its first
            raise ConnectionError("the server went away")
        return strict_judge(messages, n, seed)

    monkeypatch.setattr(datagen_helpers, "flaky_judge", flaky, raising=False)
    config = JudgeConfig(input=str(assets["root"] / "crash_in.jsonl"), output=str(tmp_path / "judged.jsonl"), batch_size=1,
                         judges=[{"name": "flaky", "backend": "python", "function": f"{HELPERS}:flaky_judge"}])  # fmt: skip
    with pytest.raises(ConnectionError):
        judge(config)
    given = calls["n"] - 1  # the third record's other requests went on while the failure came back
    summary = judge(config)
    total = 18  # 6 records x 3 responses
    assert summary["resumed"] == 2 and summary["cached_answers"] == given - 6 >= 1
    assert summary["requests"] == total - given
    assert calls["n"] == total + 1  # every response asked once, and the one that failed again
    clean = tmp_path / "clean.jsonl"
    judge(JudgeConfig(input=config.input, output=str(clean), judges=_judges("strict")))
    assert [row["judgments"] for row in read_jsonl(config.output)] == [
        [[{**j, "judge": "flaky"} for j in js] for js in row["judgments"]] for row in read_jsonl(clean)
    ]


def test_mix_by_counts_and_ratios(tmp_path):
    from trainer_helpers import write_longrm_jsonl

    from trl_longrm.data import load_preference_dataset
    from trl_longrm.datagen.mix import MixConfig, mix

    long = write_longrm_jsonl(tmp_path / "long.jsonl", 10, num_rejected=2, seed=1)
    short = write_jsonl(tmp_path / "short.jsonl", [{"prompt": [{"role": "user", "content": f"q{i}"}],
                                                   "chosen": [{"role": "assistant", "content": "good"}],
                                                   "rejected": [{"role": "assistant", "content": "bad"}]} for i in range(20)])  # fmt: skip
    output = tmp_path / "mix.jsonl"
    summary = mix(MixConfig(output=str(output), sources=[{"path": long, "count": 6, "name": "long"},
                                                         {"path": short, "count": 9, "name": "short"}]))  # fmt: skip
    rows = read_jsonl(output)
    assert summary["rows_by_source"] == {"long": 6, "short": 9} and len(rows) == 15
    assert [r["source"] for r in rows] != ["long"] * 6 + ["short"] * 9  # shuffled
    assert len(load_preference_dataset(str(output))) == 15  # what the trainers read
    mix(MixConfig(output=str(output), total=10, sources=[{"path": long, "ratio": 0.3}, {"path": short, "ratio": 0.7}]))
    assert [r["source"] for r in read_jsonl(output)].count(short) == 7
    with pytest.raises(DataFormatError, match=r"long.jsonl: 11 rows asked of 10"):
        mix(MixConfig(output=str(output), sources=[{"path": long, "count": 11}]))
    with pytest.raises(RunConfigError, match="exactly one of `count` and `ratio`"):
        MixConfig(output=str(output), sources=[{"path": long}])


def test_distill_keeps_the_argmax_of_the_reward_models_scores(assets, tmp_path):
    from trl_longrm.datagen.distill import DistillConfig, distill
    from trl_longrm.evaluation.judges import DiscriminativeJudge, JudgeRequest

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": f"p{i}", "prompt": [{"role": "user", "content": f"Tell me about river {i}."}]} for i in range(4)
    ])  # fmt: skip
    output = tmp_path / "distilled.jsonl"
    summary = distill(DistillConfig(input=prompts, output=str(output), num_rollouts=3, max_new_tokens=6,
                                    policy={"name": "policy", "model": assets["policy"]},
                                    scorer={"model_path": assets["disrm"], "max_length": 512}))  # fmt: skip
    rows = read_jsonl(output)
    assert summary["written"] == 4
    reference = DiscriminativeJudge.from_pretrained(assets["disrm"], max_length=512, shared_prefix=False)
    for row in rows:
        prompt = row["messages"][:-1]
        expected = reference.judge([JudgeRequest(row["id"], prompt, "", row["rollouts"], ranking=False)])[0].scores
        assert row["scores"] == pytest.approx(expected, abs=1e-4)
        assert row["kept"] == max(range(3), key=lambda i: expected[i])
        assert row["messages"][-1] == {"role": "assistant", "content": row["rollouts"][row["kept"]]}


def test_distill_continues_a_prefilled_answer_and_keeps_it_whole(assets, tmp_path):
    # A `prompt` ending with an assistant turn (TRL's prefilled answer): the policy continues it, the reward model
    # scores the prompt without it and the whole answer, the SFT row holds one assistant turn.
    from trl_longrm.datagen.distill import DistillConfig, distill
    from trl_longrm.datagen.models import ModelSpec, build_chat_model
    from trl_longrm.evaluation.judges import DiscriminativeJudge, JudgeRequest
    from trl_longrm.serving.sampling import Sampling

    question = [{"role": "user", "content": "Which word does record C02 hold?"}]
    prefill = {"role": "assistant", "content": "Record C02 holds the word"}
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "p0", "prompt": [*question, prefill]}])
    output = tmp_path / "distilled.jsonl"
    distill(DistillConfig(input=prompts, output=str(output), num_rollouts=3, max_new_tokens=4, temperature=0.0,
                          policy={"name": "policy", "model": assets["policy"]},
                          scorer={"model_path": assets["disrm"], "max_length": 512}))  # fmt: skip
    (row,) = read_jsonl(output)
    policy = build_chat_model(ModelSpec(name="policy", model=assets["policy"]))
    [[continued]] = policy.answer([[*question, prefill]], 4, [Sampling(n=1, temperature=0.0)])
    [[new_turn]] = policy.answer([question], 4, [Sampling(n=1, temperature=0.0)])
    assert continued.prompt_tokens != new_turn.prompt_tokens  # a continued turn, not a new one after the prefill
    assert row["rollouts"] == [prefill["content"] + continued.text] * 3  # greedy: three times the same
    assert row["messages"] == [*question, {"role": "assistant", "content": row["rollouts"][row["kept"]]}]
    reference = DiscriminativeJudge.from_pretrained(assets["disrm"], max_length=512, shared_prefix=False)
    expected = reference.judge([JudgeRequest("p0", question, "", row["rollouts"], ranking=False)])[0].scores
    assert row["scores"] == pytest.approx(expected, abs=1e-4)
    # In `messages` (a whole conversation), a final assistant turn is the answer to replace, not a prefill.
    again = write_jsonl(tmp_path / "conversations.jsonl", [{"id": "p0", "messages": [*question, prefill]}])
    distill(DistillConfig(input=again, output=str(tmp_path / "replaced.jsonl"), num_rollouts=2, max_new_tokens=4,
                          temperature=0.0, policy={"name": "policy", "model": assets["policy"]},
                          scorer={"model_path": assets["disrm"], "max_length": 512}))  # fmt: skip
    assert read_jsonl(tmp_path / "replaced.jsonl")[0]["rollouts"] == [new_turn.text] * 2


def test_distill_reads_a_pairwise_verdict_through_the_display_order(assets, tmp_path):
    from trl_longrm.datagen.distill import DistillConfig, distill
    from trl_longrm.evaluation.judges import ScriptedJudge

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": f"Say {i}."} for i in range(6)])
    shown = {}

    def verdict(request):
        shown[request.record_id] = request.responses
        return "B is better. [[B]]"

    judge = ScriptedJudge(verdict)
    judge.protocol = "pairwise"
    output = tmp_path / "pairwise.jsonl"
    distill(DistillConfig(input=prompts, output=str(output), max_new_tokens=6,
                          policy={"name": "policy", "model": assets["policy"]}), judge=judge)  # fmt: skip
    for row in read_jsonl(output):
        assert row["completion"] == shown[row["id"]][1] == row["rollouts"][row["kept"]]
    assert {row["kept"] for row in read_jsonl(output)} == {0, 1}  # both display orders occurred


def test_a_prompts_file_with_its_own_verdict_and_record_columns(tmp_path):
    from trl_longrm.datagen.prompts import DataPrompts
    from trl_longrm.datagen.records import Location

    path = tmp_path / "prompts.yaml"
    path.write_text(
        'verdict: "[[N]]"\ntrain:\n  system: {faithfulness: "Judge the response."}\n'
        '  user: "# Task\\n{instruction}\\n\\n{context}\\n\\n{question}\\n# Response\\n{response}"\n'
        'judge:\n  system: {faithfulness: "Judge."}\n  user: "{context} {response}"\n'
    )
    prompts = DataPrompts.from_yaml(path)
    assert (prompts.parse_score("Fine. [[7]]"), prompts.parse_score("[Score: 8]"), prompts.parse_score("[[12]]")) == (
        7,
        -1,
        -1,
    )
    record = {"instruction": "Answer from the notes."}
    messages = prompts.train_messages("faithfulness", "CTX", "Q?", "R", None, record)
    assert messages == [{"role": "system", "content": "Judge the response."},
                        {"role": "user", "content": "# Task\nAnswer from the notes.\n\nCTX\n\nQ?\n# Response\nR"}]  # fmt: skip
    with pytest.raises(DataFormatError, match=r"in.jsonl, line 4, key 'instruction'"):
        prompts.check_record("train", Location("in.jsonl", line=4), {"question": "Q?"})
    path.write_text('verdict: "[N]"\n')
    with pytest.raises(DataFormatError, match="key 'verdict'"):
        DataPrompts.from_yaml(path)
