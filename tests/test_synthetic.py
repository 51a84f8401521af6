"""The synthetic judging suite: determinism, formats, consistency of responses and verdicts with the documents,
held-out keys, length buckets, and the CLI."""

import json
import re

import pytest

from trl_longrm.data import load_preference_dataset, load_sft_dataset
from trl_longrm.evaluation.benchmark import load_benchmark
from trl_longrm.evaluation.config import FORMATS, TASKS
from trl_longrm.evaluation.prompts import (
    PAIRWISE_SYSTEM_PROMPT,
    build_judge_messages,
    build_pointwise_messages,
    parse_pairwise_verdict,
    parse_pointwise_score,
    parse_ranking_verdict,
)
from trl_longrm.evaluation.runner import display_orders, make_request
from trl_longrm.synthetic import (
    SURFACES,
    VALUES,
    SyntheticConfig,
    count_errors,
    generate_synthetic_suite,
    key_split,
    parse_facts,
)
from trl_longrm.synthetic.__main__ import main as cli_main


SMALL = dict(
    num_train=21,
    train_tokens=(80, 200),
    lengths={"4k": 120, "8k": 250, "16k": 500},
    pairwise_per_bucket=2,
    bestofn_per_bucket=3,
)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return generate_synthetic_suite(tmp_path_factory.mktemp("suite"), seed=3, **SMALL)


@pytest.fixture(scope="module")
def absent_suite(tmp_path_factory):
    return generate_synthetic_suite(tmp_path_factory.mktemp("absent"), seed=3, swap_probability=0.0, **SMALL)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def all_files(suite):
    return sorted(p for p in suite.root.rglob("*") if p.is_file())


def task_of_document(text):
    """The task whose surface the document uses (each surface has its own fact sentence)."""
    found = [task for task in SURFACES if parse_facts(task, text)]
    assert len(found) == 1, found
    return found[0]


def document_of(user_content):
    return user_content.split("\n\n# Question\n")[0]


def displayed_responses(judge_user_content):
    return re.findall(r"# Response ([A-Z])\n(.*?)\n# End of Response \1", judge_user_content, flags=re.S)


def test_values_are_single_tokens_and_absent_from_templates(tokenizer):
    from trl_longrm.synthetic.world import FILLER_WORDS

    assert not set(VALUES) & set(FILLER_WORDS)
    for value in VALUES:
        assert len(tokenizer(" " + value, add_special_tokens=False)["input_ids"]) == 1, value
    judge_texts = [m["content"] for n in (2, 3, 4) for m in build_judge_messages("task", ["x"] * n, ranking=n > 2)]
    for surface in SURFACES.values():
        text = " ".join([surface.fact, surface.question, surface.title, surface.system, *judge_texts])
        for value in VALUES:
            assert not re.search(rf"\b{value}\b", text), value


def test_same_seed_same_files_other_seed_other_files(tmp_path, suite):
    again = generate_synthetic_suite(tmp_path / "again", seed=3, **SMALL)
    other = generate_synthetic_suite(tmp_path / "other", seed=4, **SMALL)
    names = [p.relative_to(suite.root) for p in all_files(suite)]
    assert names == [p.relative_to(again.root) for p in all_files(again)]
    assert len(names) == 3 + len(TASKS) + 1
    for name in names:
        assert (suite.root / name).read_bytes() == (again.root / name).read_bytes(), name
    assert suite.disrm.read_bytes() != other.disrm.read_bytes()
    assert (suite.benchmark / "Math.jsonl").read_bytes() != (other.benchmark / "Math.jsonl").read_bytes()


def test_files_load_through_the_data_layer_and_the_evaluator(suite):
    disrm = load_preference_dataset(str(suite.disrm))
    grm = load_preference_dataset(str(suite.grm))
    sft = load_sft_dataset(str(suite.sft))
    assert len(disrm) == len(grm) == len(sft) == SMALL["num_train"]
    assert all(len(row["rejected"]) == 3 for row in disrm)
    assert [m["role"] for m in sft[0]["messages"]] == ["system", "user", "assistant"]

    records = load_benchmark(suite.benchmark, list(TASKS), list(FORMATS))
    per_task = len(SMALL["lengths"]) * (SMALL["pairwise_per_bucket"] + SMALL["bestofn_per_bucket"])
    assert len(records) == len(TASKS) * per_task
    assert {r.task for r in records} == set(TASKS)
    assert {r.length for r in records} == set(SMALL["lengths"])
    assert sorted({len(r.candidates) for r in records if r.tasktype == "BestOfN"}) == [2, 3, 4]
    assert all(len(r.candidates) == 2 for r in records if r.tasktype == "PairWise")


@pytest.mark.parametrize("fixture", ["suite", "absent_suite"])
def test_chosen_is_consistent_and_every_rejected_contradicts_the_document(request, fixture):
    suite = request.getfixturevalue(fixture)
    swap = fixture == "suite"
    for row in read_jsonl(suite.disrm):
        document = document_of(row["chat_template"][-1]["content"])
        task = task_of_document(document)
        facts = parse_facts(task, document)
        assert count_errors(task, document, row["chosen"]) == 0
        (key,) = parse_facts(task, row["chosen"])
        assert len(set(row["rejects"])) == len(row["rejects"])
        for rejected in row["rejects"]:
            (wrong_key, wrong_value), *_ = parse_facts(task, rejected).items()
            assert wrong_key == key and wrong_value != facts[key]
            # A swap distractor is stated in the document for another key; an absent one is nowhere in it.
            assert (wrong_value in facts.values()) == swap

    for path in sorted(suite.benchmark.glob("*.jsonl")):
        for record in read_jsonl(path):
            document = document_of(record["prompt_template"][-1]["content"])
            task = path.stem
            candidates = record.get("candidates") or [record["chosen"], record["rejected"]]
            # Best first: the k-th candidate has exactly k wrong values.
            assert [count_errors(task, document, c) for c in candidates] == list(range(len(candidates)))


def verdict(text, n, ranking):
    return parse_ranking_verdict(text, n) if ranking else parse_pairwise_verdict(text)


@pytest.fixture(scope="module")
def no_evidence_suite(tmp_path_factory):
    return generate_synthetic_suite(tmp_path_factory.mktemp("bare"), seed=3, judgment_evidence=False, **SMALL)


@pytest.mark.parametrize("fixture", ["suite", "no_evidence_suite"])
def test_judge_data_uses_the_evaluator_prompt_and_the_right_verdicts(request, fixture):
    suite = request.getfixturevalue(fixture)
    evidence = fixture == "suite"
    for row in read_jsonl(suite.sft) + read_jsonl(suite.grm):
        system, user = row["chat_template"]
        shown = displayed_responses(user["content"])
        ranking = len(shown) > 2 or system["content"] != PAIRWISE_SYSTEM_PROMPT
        task_text = user["content"].split("\n\n# Response A\n")[0]
        assert task_text.startswith("# Task\n")
        document = document_of(task_text)
        task = task_of_document(document)
        errors = [count_errors(task, document, text) for _, text in shown]
        # Gold rank of each displayed response from its number of wrong values (distinct by construction).
        gold = [sorted(errors).index(e) for e in errors]

        answer = row.get("golden", row.get("chosen"))
        assert verdict(answer, len(shown), ranking) == gold, answer
        # The evidence line quotes the document's facts for the asked keys; without it the answer starts counting.
        assert answer.startswith("Evidence: " if evidence else "Response A: "), answer
        if evidence:
            quoted = parse_facts(task, answer.splitlines()[0])
            assert quoted and all(parse_facts(task, document)[key] == value for key, value in quoted.items())
        for position, (letter, text) in enumerate(shown):
            asked = len(parse_facts(task, text))
            assert f"Response {letter}: {asked - errors[position]}/{asked} correct." in answer.splitlines()
        for rejected in row.get("rejects", []):
            assert verdict(rejected, len(shown), ranking) not in (None, gold), rejected


def test_pointwise_judge_data_scores_the_shown_response_against_the_document(tmp_path, suite):
    pointwise = generate_synthetic_suite(tmp_path, seed=3, judge_protocol="pointwise", keys_per_question=3, **SMALL)
    rows = read_jsonl(pointwise.sft) + read_jsonl(pointwise.grm)
    counts = set()
    for row in rows:
        system, user = row["chat_template"]
        task_text, rest = user["content"].split("\n\n# Response\n")
        response = rest.split("\n# End of Response")[0]
        # The prompt is the evaluator's pointwise prompt for this task text and response.
        assert row["chat_template"] == build_pointwise_messages(task_text.removeprefix("# Task\n"), response)
        document = document_of(task_text)
        task = task_of_document(document)
        asked = len(parse_facts(task, response))
        correct = asked - count_errors(task, document, response)
        counts.add(correct == asked)
        answer = row.get("golden", row.get("chosen"))
        assert answer.splitlines()[-2] == f"Response: {correct}/{asked} correct."
        # The score is the fraction right on the 0..9 scale (all right: 9, all wrong: 0).
        assert parse_pointwise_score(answer) == round(9 * correct / asked)
        for rejected in row.get("rejects", []):
            assert parse_pointwise_score(rejected) not in (None, parse_pointwise_score(answer)), rejected
    assert counts == {True, False}, "both right and wrong responses are shown"
    # Every response of an example gets its own row, next to the others: with pairwise examples only, rows 2i and
    # 2i+1 judge the right and the wrong response to one document.
    pairs = generate_synthetic_suite(
        tmp_path / "pairs", seed=3, judge_protocol="pointwise", ranking_fraction=0.0, length_curriculum=True, **SMALL
    )
    for path in (pairs.sft, pairs.grm):
        rows = read_jsonl(path)
        assert len(rows) == 2 * SMALL["num_train"]
        for first, second in zip(rows[::2], rows[1::2]):
            task_text = [r["chat_template"][1]["content"].split("\n\n# Response\n")[0] for r in (first, second)]
            assert task_text[0] == task_text[1]
            scores = sorted(parse_pointwise_score(r.get("golden", r.get("chosen"))) for r in (first, second))
            assert scores == [0, 9]
    # DisRM data and benchmark do not depend on the judge protocol.
    assert (
        pointwise.disrm.read_text()
        == generate_synthetic_suite(tmp_path / "pairwise", seed=3, keys_per_question=3, **SMALL).disrm.read_text()
    )


def test_judge_prompt_matches_what_the_evaluator_shows(suite):
    """A benchmark record judged by the runner gets a prompt of the same layout as the SFT rows."""
    record = load_benchmark(suite.benchmark, ["Code"], ["PairWise"])[0]
    request = make_request(record, display_orders([record], seed=42)[record.id])
    surface = SURFACES["Code"]
    assert request.task_prompt.startswith(f"{surface.system}\n\n# {surface.title}\n")
    sft_code = [r for r in read_jsonl(suite.sft) if parse_facts("Code", document_of(r["chat_template"][1]["content"]))]
    assert sft_code, "num_train covers every task"
    assert sft_code[0]["chat_template"][1]["content"].startswith(f"# Task\n{surface.system}\n\n# {surface.title}\n")


def test_benchmark_keys_are_held_out_from_training(suite):
    train_keys = set()
    for path in (suite.disrm, suite.grm, suite.sft):
        for row in read_jsonl(path):
            text = " ".join(m["content"] for m in row["chat_template"])
            train_keys |= {key for surface in SURFACES.values() for key, _ in surface.pattern().findall(text)}
    # Only the fact sentences carry keys: also read the asked keys back from the questions.
    assert train_keys and all(key_split(k) == "train" for k in train_keys)
    bench_keys = set()
    for path in suite.benchmark.glob("*.jsonl"):
        for record in read_jsonl(path):
            bench_keys |= set(parse_facts(path.stem, record["prompt_template"][-1]["content"]))
    assert bench_keys and not bench_keys & train_keys


def test_length_buckets_are_monotone_and_near_their_targets(suite, tokenizer):
    by_bucket = {}
    for path in suite.benchmark.glob("*.jsonl"):
        for record in read_jsonl(path):
            ids = tokenizer.apply_chat_template(record["prompt_template"], tokenize=True)["input_ids"]
            by_bucket.setdefault(record["ctx_length_for_length"], []).append((len(ids), record["ctx_tokens"]))
    means = []
    for bucket, target in SMALL["lengths"].items():
        lengths = by_bucket[bucket]
        assert all(target <= ctx <= target + 40 for _, ctx in lengths), (bucket, lengths)
        means.append(sum(n for n, _ in lengths) / len(lengths))
    assert means == sorted(means) and means[0] < means[-1] / 2


def test_cli_writes_the_same_suite_as_the_api(tmp_path, suite):
    args = ["--output-dir", str(tmp_path), "--seed", "3", "--num-train", "21", "--train-tokens", "80", "200"]
    args += ["--lengths", "4k=120", "8k=250", "16k=500", "--pairwise-per-bucket", "2", "--bestofn-per-bucket", "3"]
    assert cli_main(args) == 0
    for path in all_files(suite):
        assert (tmp_path / path.relative_to(suite.root)).read_bytes() == path.read_bytes(), path


def test_cli_parses_optional_fields_by_their_annotation(tmp_path):
    """`--num-train-disrm` (`int | None`) is an int, as through the API (it was parsed as text and crashed)."""
    from trl_longrm.synthetic.__main__ import build_parser

    args = build_parser().parse_args(["--output-dir", "d", "--num-train-disrm", "50", "--prompt-template", "p.yaml"])
    assert args.num_train_disrm == 50 and args.prompt_template == "p.yaml"
    common = ["--seed", "3", "--num-train", "21", "--train-tokens", "80", "200", "--lengths", "4k=120", "8k=250",
              "16k=500", "--pairwise-per-bucket", "2", "--bestofn-per-bucket", "3"]  # fmt: skip
    assert cli_main(["--output-dir", str(tmp_path), *common, "--num-train-disrm", "30"]) == 0
    assert len(read_jsonl(tmp_path / "disrm" / "train.jsonl")) == 30


def test_rerun_with_other_settings_replaces_the_earlier_suite(tmp_path, capsys):
    first = generate_synthetic_suite(tmp_path, seed=3, **SMALL)
    tasks = sorted(p.stem for p in first.benchmark.glob("*.jsonl"))
    assert len(tasks) > 1
    second = generate_synthetic_suite(tmp_path, seed=4, **{**SMALL, "tasks": tasks[:1]})
    counts = json.loads(second.manifest.read_text())["counts"]
    # Exactly the files the new manifest lists are there, each with the number of rows it says.
    files = {second.root / (f"{key}.jsonl" if key.startswith("bench/") else f"{key}/train.jsonl"): n
             for key, n in counts.items()}  # fmt: skip
    assert set(all_files(second)) == set(files) | {second.manifest}
    assert {path: len(read_jsonl(path)) for path in files} == files
    assert sorted(p.stem for p in second.benchmark.glob("*.jsonl")) == tasks[:1]


def test_suite_files_without_a_manifest_are_not_overwritten(tmp_path, capsys):
    stray = tmp_path / "bench" / "LongQA.jsonl"
    stray.parent.mkdir()
    stray.write_text('{"mine": true}\n')
    with pytest.raises(FileExistsError, match=rf"{tmp_path} already holds suite files \({stray}\) but no readable"):
        generate_synthetic_suite(tmp_path, seed=3, **SMALL)
    assert cli_main(["--output-dir", str(tmp_path), "--num-train", "21"]) == 1
    assert "error: " in capsys.readouterr().err and stray.read_text() == '{"mine": true}\n'
    suite = generate_synthetic_suite(tmp_path, seed=3, overwrite=True, **{**SMALL, "tasks": ["Cite"]})
    assert sorted(p.name for p in suite.benchmark.iterdir()) == ["Cite.jsonl"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tasks": ["LongQA", "Poetry"]}, "Unknown task"),
        ({"lengths": {"4k": 0}}, "lengths"),
        ({"train_tokens": (300, 100)}, "train_tokens"),
        ({"num_rejected": 0}, "num_rejected"),
        ({"swap_probability": 1.5}, "swap_probability"),
        ({"keys_per_question": 5, "min_facts": 4}, "keys_per_question"),
        ({"judge_protocol": "listwise"}, "judge_protocol"),
    ],
)
def test_bad_settings_fail_clearly(overrides, message):
    with pytest.raises(ValueError, match=message):
        SyntheticConfig(**overrides)


def test_keys_per_question_asks_several_keys_and_rejects_get_every_one_wrong(tmp_path):
    suite = generate_synthetic_suite(tmp_path, seed=5, swap_probability=0.0, keys_per_question=3, **SMALL)
    for row in read_jsonl(suite.disrm):
        document = document_of(row["chat_template"][-1]["content"])
        task = task_of_document(document)
        assert len(parse_facts(task, row["chosen"])) == 3 and count_errors(task, document, row["chosen"]) == 0
        assert [count_errors(task, document, r) for r in row["rejects"]] == [3] * len(row["rejects"])
    pairwise = [r for p in suite.benchmark.glob("*.jsonl") for r in read_jsonl(p) if r["tasktype"] == "PairWise"]
    assert pairwise
    for record in pairwise:
        document = document_of(record["prompt_template"][-1]["content"])
        task = task_of_document(document)
        assert [count_errors(task, document, r) for r in (record["chosen"], record["rejected"])] == [0, 3]


def test_suite_tokenizer_makes_suite_words_single_tokens(suite, tokenizer):
    from trl_longrm.synthetic.suite import tokenizer_corpus
    from trl_longrm.testing_utils import build_chat_tokenizer

    suite_tokenizer = build_chat_tokenizer(1024, tokenizer_corpus())
    row = read_jsonl(suite.disrm)[0]
    text = row["chat_template"][-1]["content"] + " " + row["chosen"]
    small, default = suite_tokenizer(text)["input_ids"], tokenizer(text)["input_ids"]
    # Every word of the suite's surfaces is one token (the default tokenizer spells many of them letter by letter).
    for surface in SURFACES.values():
        for word in re.findall(r"[A-Za-z]+", surface.fact.replace("{key}", "").replace("{value}", "")):
            assert len(suite_tokenizer(" " + word)["input_ids"]) == 1, word
    for value in VALUES:
        assert len(suite_tokenizer(" " + value)["input_ids"]) == 1, value
    assert len(small) < 0.6 * len(default)
    assert suite_tokenizer.decode(small) == text  # byte-level: still round-trips


def test_length_curriculum_writes_the_same_rows_shortest_first(tmp_path, suite):
    # Through the CLI, so that the boolean flag is checked too (`--no-length-curriculum` must mean False).
    args = ["--seed", "3", "--num-train", "21", "--train-tokens", "80", "200"]
    args += ["--lengths", "4k=120", "8k=250", "16k=500", "--pairwise-per-bucket", "2", "--bestofn-per-bucket", "3"]
    assert cli_main(["--output-dir", str(tmp_path / "off"), "--no-length-curriculum", *args]) == 0
    assert cli_main(["--output-dir", str(tmp_path / "on"), "--length-curriculum", *args]) == 0
    for name in ("sft/train.jsonl", "grm/train.jsonl", "disrm/train.jsonl"):
        plain = read_jsonl(suite.root / name)
        assert read_jsonl(tmp_path / "off" / name) == plain
        ordered = read_jsonl(tmp_path / "on" / name)
        lengths = [row["ctx_tokens"] for row in ordered]
        assert lengths == sorted(lengths) and lengths != [row["ctx_tokens"] for row in plain]
        # The same rows, none lost or changed: only the order differs (stable for equal lengths).
        assert ordered == sorted(plain, key=lambda row: row["ctx_tokens"])
    # The benchmark is not reordered.
    for path in suite.benchmark.glob("*.jsonl"):
        assert (tmp_path / "on" / "bench" / path.name).read_bytes() == path.read_bytes()


def test_demo_suite_needs_the_document_a_response_only_model_stays_at_chance(tmp_path):
    """The demo's DisRM task cannot be solved from the responses alone: a bag-of-words logistic regression trained on
    the DisRM rows' responses (chosen = 1, rejected = 0) stays near chance on the benchmark's PairWise records, while
    the rule "every value the response gives appears in the document" is right on all of them."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import balanced_accuracy_score

    from trl_longrm.demo import DEMO_DATA

    suite = generate_synthetic_suite(tmp_path, **{**DEMO_DATA, "num_train": 1500, "seed": 0})
    rows = read_jsonl(suite.disrm)
    texts = [row["chosen"] for row in rows] + [r for row in rows for r in row["rejects"]]
    labels = [1] * len(rows) + [0] * (len(texts) - len(rows))
    vectorizer = CountVectorizer(token_pattern=r"[A-Za-z0-9]+")
    # Balanced: with several rejected responses per row, "always rejected" alone would score 1 - 1 / (1 + k).
    classifier = LogisticRegression(max_iter=2000, class_weight="balanced")
    classifier.fit(vectorizer.fit_transform(texts), labels)
    fitted = balanced_accuracy_score(labels, classifier.predict(vectorizer.transform(texts)))
    assert fitted < 0.7  # it cannot even fit the training rows

    pairs = [r for p in suite.benchmark.glob("*.jsonl") for r in read_jsonl(p) if r["tasktype"] == "PairWise"]
    assert len(pairs) == 7 * 3 * DEMO_DATA["pairwise_per_bucket"]
    scores = classifier.decision_function(
        vectorizer.transform([r["chosen"] for r in pairs] + [r["rejected"] for r in pairs])
    )
    blind = sum(c > r for c, r in zip(scores[: len(pairs)], scores[len(pairs) :])) / len(pairs)
    assert 0.35 < blind < 0.65, blind

    def all_values_stated(record, response):
        document = document_of(record["prompt_template"][-1]["content"])
        stated = set(parse_facts(task_of_document(document), document).values())
        return all(value in stated for value in parse_facts(task_of_document(document), response).values())

    assert all(all_values_stated(r, r["chosen"]) and not all_values_stated(r, r["rejected"]) for r in pairs)


def test_judge_data_is_written_with_the_prompt_template_the_judge_is_evaluated_with(tmp_path, suite):
    from trl_longrm.demo import JUDGE_PROMPTS
    from trl_longrm.evaluation.templates import PromptTemplate

    template = PromptTemplate.from_yaml(JUDGE_PROMPTS)
    custom = generate_synthetic_suite(
        tmp_path / "custom", seed=3, judge_protocol="pointwise", prompt_template=str(JUDGE_PROMPTS), **SMALL
    )
    built_in = generate_synthetic_suite(tmp_path / "built_in", seed=3, judge_protocol="pointwise", **SMALL)
    for path in ("sft", "grm"):
        rows, reference = read_jsonl(getattr(custom, path)), read_jsonl(getattr(built_in, path))
        assert len(rows) == len(reference)
        for row, ref in zip(rows, reference):
            system, user = row["chat_template"]
            assert system == {"role": "system", "content": "Judge the response."}
            # The same task and response, in the template's prompt (the built-in one for the built-in suite).
            task_text, rest = ref["chat_template"][1]["content"].split("\n\n# Response\n")
            response = rest.split("\n# End of Response")[0]
            assert row["chat_template"] == template.pointwise_messages(task_text.removeprefix("# Task\n"), response)
            assert ref["chat_template"] == build_pointwise_messages(task_text.removeprefix("# Task\n"), response)
            assert {k: v for k, v in row.items() if k != "chat_template"} == {
                k: v for k, v in ref.items() if k != "chat_template"
            }
    # What the judge is not asked about is the same (the benchmark, the DisRM data).
    assert custom.disrm.read_text() == built_in.disrm.read_text()
    assert [p.read_text() for p in sorted(custom.benchmark.glob("*.jsonl"))] == [
        p.read_text() for p in sorted(built_in.benchmark.glob("*.jsonl"))
    ]
    # A pointwise verdict the synthetic judgments do not write is refused, naming the file and the key.
    score = tmp_path / "score.yaml"
    score.write_text(
        "pointwise:\n  system: Judge.\n  user: \"{task} {response}\"\n  verdict: \"[Score: N]\"\n", encoding="utf-8"
    )
    with pytest.raises(ValueError, match=r"score.yaml: key `pointwise.verdict`"):
        generate_synthetic_suite(tmp_path / "bad", seed=3, judge_protocol="pointwise", prompt_template=str(score), **SMALL)


def test_disrm_set_can_have_its_own_size(tmp_path):
    """`num_train_disrm` sizes the DisRM set alone; its groups extend the `num_train` set's (same rows first)."""
    base = generate_synthetic_suite(tmp_path / "a", **{**SMALL, "num_train": 12, "length_curriculum": False})
    more = generate_synthetic_suite(
        tmp_path / "b", **{**SMALL, "num_train": 12, "num_train_disrm": 20, "length_curriculum": False}
    )
    assert len(read_jsonl(more.disrm)) == 20 and read_jsonl(more.disrm)[:12] == read_jsonl(base.disrm)
    assert read_jsonl(more.sft) == read_jsonl(base.sft) and read_jsonl(more.grm) == read_jsonl(base.grm)
    with pytest.raises(ValueError, match="num_train_disrm must be >= 1"):
        generate_synthetic_suite(tmp_path / "c", **{**SMALL, "num_train_disrm": 0})
