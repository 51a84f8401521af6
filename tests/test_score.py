"""`trl-longrm score` / `score()`: a DisRM's scores as plain transformers reads them, rows kept in input order, a
generative judge's pointwise scores and judgments, resume after a stop (refused under settings that change scores),
several processes, and every user mistake as one error line (file, line and key) that blocks no corrected command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_error, run_cli
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from trl_longrm.data import DataFormatError, scoring_ids
from trl_longrm.data.errors import RunConfigError
from trl_longrm.evaluation.score import ScoreConfig, read_rows, score
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model


ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    {"id": "a", "prompt": [{"role": "user", "content": "Which city has the river?"}],
     "completions": ["The river city.", "A planet.", "The capital of the book"]},
    {"id": "b", "prompt": "Is the river long? Answer:", "completions": [" yes", " no it is short"]},
    {"id": "c", "prompt": [{"role": "system", "content": "Judge."}, {"role": "user", "content": "Name a color."}],
     "completions": [[{"role": "assistant", "content": "red"}], [{"role": "assistant", "content": "the animal"}]]},
]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    tokenizer = build_chat_tokenizer()
    return {
        "disrm": save_tiny_model(root / "disrm", task="seq-cls", tokenizer=tokenizer, seed=7),
        "grm": save_tiny_model(root / "grm", tokenizer=tokenizer, seed=8),
    }


def write_rows(path: Path, rows=ROWS) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def reference_scores(model_path: str, row: dict) -> list[float]:
    """Each completion scored alone by plain transformers: the chat rendering (or prompt + completion + EOS for a
    plain-text row, as the DisRM trainers build it), read at its last token by the model's own pooling."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    scores = []
    for ids in scoring_ids(tokenizer, row["prompt"], row["completions"]):
        if isinstance(row["prompt"], list):
            completion = row["completions"][len(scores)]
            messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            rendered = tokenizer.apply_chat_template(row["prompt"] + messages, tokenize=False)
            assert tokenizer(rendered, add_special_tokens=False)["input_ids"] == ids
        with torch.no_grad():
            scores.append(model(torch.tensor([ids])).logits[0, 0].item())
    return scores


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_disrm_scores_rows_in_input_order(models, tmp_path, shared_prefix):
    data = write_rows(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    returned = score(ScoreConfig(model_path=models["disrm"], data_path=data, output=str(out), device="cpu",
                                 batch_size=2, shared_prefix=shared_prefix))  # fmt: skip
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == returned and [row["id"] for row in written] == ["a", "b", "c"]
    for row, scored in zip(ROWS, written):
        assert {k: v for k, v in scored.items() if k != "scores"} == row  # the row's other keys, unchanged
        assert scored["scores"] == pytest.approx(reference_scores(models["disrm"], row), abs=1e-4)


def test_generative_judge_scores_pointwise_with_judgments(models, tmp_path):
    data = write_rows(tmp_path / "in.jsonl", ROWS[:2])
    rows = score(ScoreConfig(model_path=models["grm"], data_path=data, output=str(tmp_path / "out.jsonl"),
                             device="cpu", max_new_tokens=6))  # fmt: skip
    for row, scored in zip(ROWS, rows):
        assert len(scored["scores"]) == len(scored["judgments"]) == len(row["completions"])
        assert all(isinstance(s, float) and 0 <= s <= 9 for s in scored["scores"])  # expected score over [[0..9]]
        assert all(isinstance(j, str) for j in scored["judgments"])


def test_a_stopped_run_resumes(models, tmp_path):
    from trl_longrm.evaluation.judges import DiscriminativeJudge

    data = write_rows(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    config = ScoreConfig(model_path=models["disrm"], data_path=data, output=str(out), device="cpu", batch_size=1)
    judge = DiscriminativeJudge.from_pretrained(models["disrm"], device="cpu")
    calls = []

    class Stopping:
        model_type = "DisRM"

        def judge(self, requests):
            calls.append(len(requests))
            if len(calls) == 2:
                raise KeyboardInterrupt
            return judge.judge(requests)

    with pytest.raises(KeyboardInterrupt):
        score(config, judge=Stopping())
    assert not out.exists() and len((tmp_path / "out.jsonl.parts" / "rank0.jsonl").read_text().splitlines()) == 1
    calls.clear()

    class Counting(Stopping):
        def judge(self, requests):
            calls.append(len(requests))
            return judge.judge(requests)

    resumed = score(config, judge=Counting())
    assert calls == [1, 1]  # the two rows not scored before the stop
    fresh = score(ScoreConfig(model_path=models["disrm"], data_path=data, output=str(tmp_path / "fresh.jsonl"),
                              device="cpu"))  # fmt: skip
    assert sum([r["scores"] for r in resumed], []) == pytest.approx(sum([r["scores"] for r in fresh], []), abs=1e-5)
    # Another input under the same output: refused rather than mixed.
    other = write_rows(tmp_path / "in.jsonl", ROWS[:2])
    with pytest.raises(RunConfigError, match="other settings"):
        score(ScoreConfig(model_path=models["disrm"], data_path=other, output=str(out), device="cpu"))


def test_bad_rows_are_named_before_any_model_loads(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "completions": ["a"]}\nnot json\n{"prompt": 3, "completions": []}\n'
                   '{"completions": ["a"], "scores": [1]}\n')  # fmt: skip
    with pytest.raises(DataFormatError) as error:
        read_rows(bad)
    message = str(error.value)
    for expected in ("line 2: not valid JSON", "line 3: key `prompt`", "line 3: key `completions`",
                     "line 4: key `prompt` is missing", "line 4: key `scores`"):  # fmt: skip
        assert f"{bad}, {expected}" in message
    run = subprocess.run([sys.executable, "-m", "trl_longrm", "score", "--model-path", str(tmp_path / "no_model"),
                          "--data-path", str(bad), "--output", str(tmp_path / "o.jsonl")],
                         capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.count("trl-longrm: error:") == 1 and f"{bad}, line 2" in run.stderr


@pytest.mark.slow
def test_two_processes_score_as_one(models, tmp_path):
    data = write_rows(tmp_path / "in.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "trl_longrm", "score", "--model-path", models["disrm"],
                          "--data-path", data, "--output", str(tmp_path / "two.jsonl"), "--device", "cpu",
                          "--batch-size", "1", "--num-processes", "2"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    shards = sorted(p.name for p in (tmp_path / "two.jsonl.parts").glob("rank*.jsonl"))
    assert shards == ["rank0.jsonl", "rank1.jsonl"]
    one = score(ScoreConfig(model_path=models["disrm"], data_path=data, output=str(tmp_path / "one.jsonl"),
                            device="cpu"))  # fmt: skip
    two = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [r["id"] for r in two] == ["a", "b", "c"]
    assert sum([r["scores"] for r in two], []) == pytest.approx(sum([r["scores"] for r in one], []), abs=1e-5)


def run_score_cli(capsys, *argv) -> tuple[int, str]:
    return run_cli(capsys, "score", *argv)


def test_user_columns_named_like_bookkeeping_are_kept(models, tmp_path):
    rows = [{"_line": "mine", "line": 7, "prompt": "Is the river long? Answer:", "completions": [" yes", " no"]}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    written = score(ScoreConfig(model_path=models["disrm"], data_path=data, output=str(tmp_path / "out.jsonl"),
                                device="cpu"))  # fmt: skip
    assert [{k: v for k, v in row.items() if k != "scores"} for row in written] == rows
    assert written[0]["scores"] == pytest.approx(reference_scores(models["disrm"], rows[0]), abs=1e-4)


@pytest.mark.parametrize(
    "model, change, setting",
    [("disrm", {"dtype": "float32"}, "dtype"), ("disrm", {"shared_prefix": False}, "shared_prefix"),
     ("grm", {"max_new_tokens": 5}, "max_new_tokens")],
)  # fmt: skip
def test_resume_refuses_a_setting_that_changes_scores(models, tmp_path, model, change, setting):
    data = write_rows(tmp_path / "in.jsonl", ROWS[1:2])
    settings = dict(model_path=models[model], data_path=data, output=str(tmp_path / "out.jsonl"), device="cpu",
                    max_new_tokens=4)  # fmt: skip
    first = score(ScoreConfig(**settings))
    with pytest.raises(RunConfigError, match=rf"other settings \({setting}: "):
        score(ScoreConfig(**{**settings, **change}))
    # The same settings resume (nothing left to score), and the batch size is no setting of the scores.
    assert score(ScoreConfig(**{**settings, "batch_size": 3})) == first


def test_resume_refuses_an_edited_template(models, tmp_path, capsys):
    from trl_longrm.evaluation.templates import PromptTemplate

    pointwise = PromptTemplate.default().pointwise
    section = {"system": pointwise.system, "user": pointwise.user, "verdict": pointwise.verdict}
    template = tmp_path / "prompts.yaml"
    template.write_text(json.dumps({"pointwise": section}))  # JSON is YAML
    data = write_rows(tmp_path / "in.jsonl", ROWS[1:2])
    argv = ["--model-path", models["grm"], "--data-path", data, "--output", str(tmp_path / "out.jsonl"), "--device",
            "cpu", "--max-new-tokens", "4", "--prompt-template", str(template)]  # fmt: skip
    assert run_score_cli(capsys, *argv)[0] == 0
    # The same prompt read from another file is the same setting: the run resumes.
    moved = tmp_path / "moved.yaml"
    moved.write_text(template.read_text())
    assert run_score_cli(capsys, *argv[:-1], str(moved))[0] == 0
    template.write_text(json.dumps({"pointwise": {**section, "system": "Rate the response."}}))
    assert_one_error(*run_score_cli(capsys, *argv), "out.jsonl.parts holds rows scored with other settings",
                     "prompt_template: ")  # fmt: skip


def test_a_run_that_scored_nothing_does_not_lock_its_output(models, tmp_path, capsys):
    data = write_rows(tmp_path / "in.jsonl", ROWS[1:2])
    argv = ["--model-path", models["grm"], "--data-path", data, "--output", str(tmp_path / "out.jsonl"), "--device",
            "cpu", "--max-new-tokens", "4"]  # fmt: skip
    assert_one_error(*run_score_cli(capsys, *argv, "--is-disrm"), f"{models['grm']} is a LlamaForCausalLM checkpoint")
    assert run_score_cli(capsys, *argv)[0] == 0
    assert len(json.loads((tmp_path / "out.jsonl").read_text())["judgments"]) == 2


@pytest.mark.parametrize("mistake", ["batch_size", "num_processes", "model_path", "template", "template_for_disrm"])
def test_flag_and_model_mistakes_are_one_error_line(models, tmp_path, capsys, mistake):
    data = write_rows(tmp_path / "in.jsonl", ROWS[1:2])
    bad_template = tmp_path / "prompts.yaml"
    bad_template.write_text("pointwise: 3\n")
    argv, expected = {
        "batch_size": (["--batch-size", "0"], "`batch_size` must be >= 1, got 0"),
        "num_processes": (["--num-processes", "0"], "--num-processes must be >= 1, got 0"),
        "model_path": (["--model-path", str(tmp_path / "no_model")], f"{tmp_path / 'no_model'}"),
        "template": (["--prompt-template", str(bad_template)], f"{bad_template}: section `pointwise` must be"),
        "template_for_disrm": (["--model-path", models["disrm"], "--prompt-template", str(bad_template)],
                               f"prompt_template='{bad_template}' is for a generative judge, but {models['disrm']}"),
    }[mistake]  # fmt: skip
    model = [] if mistake in ("model_path", "template_for_disrm") else ["--model-path", models["grm"]]
    code, stderr = run_score_cli(capsys, *model, "--data-path", data, "--output", str(tmp_path / "out.jsonl"),
                                 "--device", "cpu", *argv)  # fmt: skip
    assert_one_error(code, stderr, expected)
    assert not (tmp_path / "out.jsonl").exists()


def test_bytes_that_are_not_utf8_are_named_by_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    line = b'{"prompt": "caf\xe9", "completions": ["a"]}\n'  # Latin-1, not UTF-8
    bad.write_bytes(b'{"prompt": "x", "completions": ["a"]}\n' + line)
    # The command in this process (`python -m trl_longrm score` is run as a process in the test of bad rows above).
    code, stderr = run_score_cli(capsys, "--model-path", str(tmp_path / "no_model"), "--data-path", str(bad),
                                 "--output", str(tmp_path / "o.jsonl"))  # fmt: skip
    assert_one_error(code, stderr, f"{bad}, line 2: not UTF-8 text (byte 0xe9 at byte {line.index(0xE9) + 1} of")
