"""`trl-longrm data`: a YAML pipeline end to end and resumed, the shipped pipelines, and a user's mistakes as one
message naming the file, row or server."""

from pathlib import Path

import pytest
import yaml
from datagen_helpers import read_jsonl, short_records, write_corpus, write_jsonl

from trl_longrm.cli import main
from trl_longrm.datagen.cli import read_pipeline
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model


ROOT = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve().parent / "datagen_helpers.py"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    build_chat_tokenizer().save_pretrained(root / "tokenizer")
    steps = [
        {"step": "expand", "input": write_jsonl(root / "short.jsonl", short_records(2)),
         "corpus": write_corpus(root / "corpus.jsonl"), "tokenizer": str(root / "tokenizer"),
         "output": str(root / "long.jsonl"), "target_lengths": [200, 500]},
        {"step": "respond", "output": str(root / "responses.jsonl"), "num_responses": 2, "max_new_tokens": 6,
         "models": [{"name": "tiny", "model": save_tiny_model(root / "lm", arch="qwen3", seed=2)}]},
        {"step": "judge", "output": str(root / "judged.jsonl"),
         "judges": [{"name": name, "backend": "python", "function": f"{HELPERS}:{function}"}
                    for name, function in (("a", "strict_judge"), ("b", "lenient_judge"), ("c", "strict_judge"))]},
        {"step": "vote", "sft_output": str(root / "sft.jsonl"), "simpo_output": str(root / "simpo.jsonl")},
    ]  # fmt: skip
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"steps": steps}))
    return root, path


def test_pipeline_runs_every_step_then_resumes_all_of_them(pipeline, capsys):
    root, path = pipeline
    assert main(["data", str(path)]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if " rows written to " in line] == [
        "expand",
        "respond",
        "judge",
        "vote",
    ]
    simpo, sft = read_jsonl(root / "simpo.jsonl"), read_jsonl(root / "sft.jsonl")
    assert 0 < len(simpo) <= len(sft)
    for row in simpo:
        # The strict judges agree on every response (the same text): a's is chosen, c's the same text (left out),
        # and the lenient one's is rejected where it disagrees.
        assert (row["chosen_model"], row["reject_models"]) == ("a", ["b"])
    # Each step keeps its summary; the same command finds everything done.
    first = {step: yaml.safe_load((root / f"{name}.summary.json").read_text())
             for step, name in (("respond", "responses.jsonl"), ("judge", "judged.jsonl"))}  # fmt: skip
    assert first["judge"]["requests"] == 3 * sum(len(r["responses"]) for r in read_jsonl(root / "responses.jsonl"))
    assert main(["data", str(path), "--steps", "respond", "judge"]) == 0
    for name in ("responses.jsonl", "judged.jsonl"):
        again = yaml.safe_load((root / f"{name}.summary.json").read_text())
        assert again["resumed"] == again["records"] and again["requests"] == 0 and again["written"] == 0
    # The trainers read the voted rows as they are.
    from trl_longrm.data import load_preference_dataset, load_sft_dataset

    assert len(load_preference_dataset(str(root / "simpo.jsonl"))) == len(simpo)
    assert len(load_sft_dataset(str(root / "sft.jsonl"))) == len(sft)


def test_one_step_from_the_command_line(pipeline, tmp_path):
    root, _ = pipeline
    judges = [f"{{name: {n}, backend: python, function: '{HELPERS}:strict_judge'}}" for n in ("x", "y")]
    code = main(["data", "judge", "--input", str(root / "responses.jsonl"), "--output", str(tmp_path / "j.jsonl"),
                 "--judges", *judges, "--max-new-tokens", "64"])  # fmt: skip
    assert code == 0
    assert [j["judge"] for j in read_jsonl(tmp_path / "j.jsonl")[0]["judgments"][0]] == ["x", "y"]


@pytest.mark.parametrize("name", ["longrm_stage1.yaml", "longrm_stage2.yaml", "distill.yaml"])
def test_shipped_pipelines_are_valid(name):
    from trl_longrm.datagen.consensus import LONGRM_RULES

    steps = dict(read_pipeline(ROOT / "recipes" / "data" / name))
    if name == "longrm_stage2.yaml":
        rules = steps["vote"].rules([])
        assert (rules.judge_priority, rules.reject_order) == (LONGRM_RULES.judge_priority, LONGRM_RULES.reject_order)
        assert [spec.name for spec in steps["judge"].judges] == list(LONGRM_RULES.judge_priority)
        assert steps["expand"].target_lengths == [32768, 65536, 131072]
        assert steps["respond"].input == steps["expand"].output and steps["vote"].input == steps["judge"].output


def _one_error_line(capsys):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("trl-longrm: error:")]
    assert len(lines) == 1 and "Traceback" not in err
    return lines[0]


def test_user_mistakes_are_one_message(pipeline, tmp_path, capsys):
    root, path = pipeline
    # A record without its question: the file, the line and the key, before any model loads.
    rows = read_jsonl(root / "long.jsonl")
    del rows[2]["question"]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    model = "{name: m, backend: transformers, model: /nowhere/model}"
    assert main(["data", "respond", "--input", bad, "--output", str(tmp_path / "o.jsonl"), "--models", model]) == 1
    assert "bad.jsonl, line 3, key 'question'" in _one_error_line(capsys)
    # A model that is not there.
    assert main(["data", "respond", "--input", str(root / "long.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                 "--models", model]) == 1  # fmt: skip
    assert "/nowhere/model" in _one_error_line(capsys)
    # A server that does not answer: named, with what to do.
    server = "{name: s, backend: chat, base_url: 'http://127.0.0.1:9/v1', max_retries: 0, request_timeout: 5}"
    assert main(["data", "judge", "--input", str(root / "responses.jsonl"), "--output", str(tmp_path / "j.jsonl"),
                 "--judges", server]) == 1  # fmt: skip
    assert "http://127.0.0.1:9/v1" in _one_error_line(capsys)
    # A pipeline step with a key its step does not have.
    steps = yaml.safe_load(path.read_text())["steps"]
    steps[1]["temprature"] = 0.5
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"steps": steps}))
    assert main(["data", str(typo)]) == 1
    assert "typo.yaml: steps[1] (respond): unknown key(s) ['temprature']" in _one_error_line(capsys)
