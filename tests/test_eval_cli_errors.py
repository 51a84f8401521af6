"""`trl-longrm eval`: every mistake of the user's (bad bytes, JSON, keys, flags, models) is one error line naming the
file, line and key, exit code 1 and no traceback, and a run that judged nothing leaves nothing that blocks the corrected
command."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_one_error, run_cli

from trl_longrm.evaluation import make_toy_benchmark
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_cli_errors")
    tokenizer = build_chat_tokenizer()
    bench = make_toy_benchmark(root / "bench", tasks=["LongQA"], pairwise_per_task=1, bestofn_per_task=0)
    return {
        "bench": str(bench),
        "record": (bench / "LongQA.jsonl").read_text().splitlines()[0],
        "grm": save_tiny_model(root / "grm", tokenizer=tokenizer, seed=8),
        "disrm": save_tiny_model(root / "disrm", task="seq-cls", tokenizer=tokenizer, seed=7),
    }


def run_eval_cli(capsys, *argv) -> tuple[int, str]:
    return run_cli(capsys, "eval", *argv)


@pytest.mark.parametrize(
    "content, expected",
    [
        ("", "No records to evaluate in {file} "),
        ("{record}\n{record}\n", "{file}, line 2: key `id` duplicates the record on line 1"),
        ("{record}\n{{not json\n", "{file}, line 2: not valid JSON"),
        ("{record}\n[1, 2]\n", "{file}, line 2: expected a JSON object, got list"),
        ('{{"prompt_template": [], "chosen": "a", "rejected": "b", "tasktype": "PairWise", "subtype": "same", '
         '"ctx_length_for_length": "4k"}}\n', "{file}, line 1: key `prompt_template` must be a non-empty list"),
    ],
)  # fmt: skip
def test_task_file_mistakes_are_one_error_line(paths, tmp_path, capsys, content, expected):
    file = tmp_path / "bench" / "LongQA.jsonl"
    file.parent.mkdir()
    file.write_text(content.format(record=paths["record"]))
    code, stderr = run_eval_cli(capsys, "--model-path", paths["disrm"], "--is-disrm", "--data-path",
                                str(file.parent), "--tasks", "LongQA", "--save-path", str(tmp_path / "out"))  # fmt: skip
    assert_one_error(code, stderr, expected.format(file=file))


def test_bytes_that_are_not_utf8_in_a_task_file_are_named_by_file_and_line(paths, tmp_path):
    """Through the installed entry point."""
    line = paths["record"].replace("document", "docum\xe9nt").encode("latin-1") + b"\n"  # Latin-1, not UTF-8
    (tmp_path / "bench").mkdir()
    task_file = tmp_path / "bench" / "LongQA.jsonl"
    task_file.write_bytes(paths["record"].encode() + b"\n" + line)
    run = subprocess.run([Path(sys.executable).parent / "trl-longrm", "eval", "--model-path", paths["disrm"],
                          "--is-disrm", "--data-path", str(task_file.parent), "--tasks", "LongQA", "--save-path",
                          str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    expected = f"{task_file}, line 2: not UTF-8 text (byte 0xe9 at byte {line.index(0xE9) + 1} of the line)"
    assert_one_error(run.returncode, run.stderr, expected)


def test_bytes_that_are_not_utf8_in_a_preference_file_are_named_by_file_and_line(paths, tmp_path, capsys):
    preference = tmp_path / "pairs.jsonl"
    good, bad = json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}), b'{"prompt": "q\xff", "chosen": "a"}'
    preference.write_bytes(good.encode() + b"\n" + bad + b"\n")
    code, stderr = run_eval_cli(capsys, "--model-path", paths["disrm"], "--is-disrm", "--data-path", str(preference),
                                "--save-path", str(tmp_path / "out"))  # fmt: skip
    assert_one_error(code, stderr, f"{preference}, line 2: not UTF-8 text (byte 0xff at byte 14 of the line)")


@pytest.mark.parametrize("mistake", ["batch_size", "max_new_tokens", "num_processes", "template"])
def test_flag_mistakes_are_one_error_line(paths, tmp_path, capsys, mistake):
    bad_template = tmp_path / "prompts.yaml"
    bad_template.write_text("pairwise:\n  system: x\n  user: '{task}'\n  response: '{response}'\n  verdict: '[[A]]'\n")
    argv, expected = {
        "batch_size": (["--batch-size", "0"], "`batch_size` must be >= 1, got 0"),
        "max_new_tokens": (["--max-length", "64", "--max-new-tokens", "64"], "`max_new_tokens` (64) must be below"),
        "num_processes": (["--num-processes", "0"], "--num-processes must be >= 1, got 0"),
        "template": (["--prompt-template", str(bad_template)], f"{bad_template}: key `pairwise.user` must contain"),
    }[mistake]
    code, stderr = run_eval_cli(capsys, "--model-path", paths["grm"], "--data-path", paths["bench"], "--save-path",
                                str(tmp_path / "out"), *argv)  # fmt: skip
    assert_one_error(code, stderr, expected)
    assert not (tmp_path / "out").exists()


def test_the_wrong_head_is_one_error_line_and_does_not_lock_the_save_path(paths, tmp_path, capsys):
    common = ["--data-path", paths["bench"], "--tasks", "LongQA", "--save-path", str(tmp_path / "out"),
              "--no-verdict-probs"]  # fmt: skip
    code, stderr = run_eval_cli(capsys, "--model-path", paths["grm"], "--is-disrm", *common)
    assert_one_error(code, stderr, f"{paths['grm']} is a LlamaForCausalLM checkpoint", "no --is-disrm")
    code, stderr = run_eval_cli(capsys, "--model-path", paths["disrm"], "--max-new-tokens", "4", *common)
    assert_one_error(code, stderr, f"{paths['disrm']} is a LlamaForSequenceClassification checkpoint", "--is-disrm")
    # The corrected command runs in the same folder, and records its own settings there.
    assert run_eval_cli(capsys, "--model-path", paths["grm"], "--max-new-tokens", "4", *common)[0] == 0
    assert json.loads((tmp_path / "out" / "run_config.json").read_text())["model_type"] == "GRM"
    # Once it holds predictions, the folder refuses another run's settings, naming them.
    code, stderr = run_eval_cli(capsys, "--model-path", paths["grm"], "--max-new-tokens", "5", *common)
    assert_one_error(code, stderr, "holds predictions of a different run (max_new_tokens: 4 -> 5)")


def test_a_missing_model_is_one_error_line(paths, tmp_path, capsys):
    code, stderr = run_eval_cli(capsys, "--model-path", str(tmp_path / "no_model"), "--is-disrm", "--data-path",
                                paths["bench"], "--tasks", "LongQA", "--save-path", str(tmp_path / "out"))  # fmt: skip
    assert_one_error(code, stderr, f"model_path='{tmp_path / 'no_model'}': no such file or folder")
