"""What a run checks before it loads anything: paths (`--dry_run` and the launcher), splits, and the data itself
(errors naming the file and line, an empty result explained), each reported once, as one message, without traceback."""

import json
from pathlib import Path

import pytest
from trainer_helpers import write_longrm_jsonl

from trl_longrm.testing_utils import save_tiny_model
from trl_longrm.train import main


ROOT = Path(__file__).resolve().parents[1]
TINY_SFT = str(ROOT / "recipes" / "tiny" / "sft.yaml")
TINY_GRM = str(ROOT / "recipes" / "tiny" / "simpo_grm.yaml")


@pytest.fixture(scope="module")
def model_without_weights(tmp_path_factory):
    """A model folder whose config and tokenizer load but whose weights do not: a run that reaches the model fails
    differently from one stopped by its data first."""
    path = Path(save_tiny_model(tmp_path_factory.mktemp("m") / "lm", arch="qwen3"))
    (path / "model.safetensors").unlink()
    return str(path)


def errors_of(stderr):
    return [line for line in stderr.splitlines() if line.startswith("trl-longrm: error:")]


def test_dry_run_reports_every_missing_path_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    code = main(
        [
            TINY_SFT,
            "--dry_run",
            "--model_name_or_path",
            "models/nope",
            "--dataset_name",
            "data/nope",
            "--accelerate_config",
            "nope.yaml",
            "--resume_from_checkpoint",
            "runs/checkpoint-9",
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    [header] = errors_of(err)
    assert header == "trl-longrm: error: the run cannot start:"
    problems = [line.strip() for line in err.splitlines() if line.startswith("  - ")]
    assert problems == [
        f"- dataset_name='data/nope': no such file or folder (resolved against {tmp_path})",
        "- accelerate_config: Accelerate config 'nope.yaml' not found (looked at nope.yaml, "
        f"accelerate_configs/nope.yaml, {ROOT / 'accelerate_configs' / 'nope.yaml'}).",
        "- resume_from_checkpoint='runs/checkpoint-9' cannot be resumed from: no such folder (resolved against "
        f"{tmp_path}).",
    ]
    # `models/nope` reads like a Hub id (no local `models/` folder): not an error, but said.
    assert f"note: model_name_or_path='models/nope' is no local folder (in {tmp_path}): read from the Hub" in err


def test_adapter_whose_relative_base_is_not_found_from_here(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    adapter = project / "runs" / "adapter"
    adapter.mkdir(parents=True)
    (project / "runs" / "base").mkdir()  # the base, next to the adapter: `base_model_name_or_path: ../base`
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "../base"}))
    data = write_longrm_jsonl(tmp_path / "sft.jsonl", 2, sft=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([TINY_SFT, "--dry_run", "--model_name_or_path", str(adapter), "--dataset_name", str(data)]) == 1
    err = capsys.readouterr().err
    assert (
        f"  - model_name_or_path='{adapter}' is a LoRA adapter whose base_model_name_or_path '../base': no such "
        f"file or folder (resolved against {elsewhere}); it exists relative to the adapter "
        f"({project / 'runs' / 'base'}): write that absolute path in {adapter / 'adapter_config.json'}"
    ) in err


@pytest.mark.parametrize("option,split", [("--dataset_test_split", "test"), ("--dataset_train_split", "validation")])
def test_a_split_a_single_file_cannot_have_is_an_error(tmp_path, model_without_weights, capsys, option, split):
    data = write_longrm_jsonl(tmp_path / "sft.jsonl", 4, sft=True)
    args = [TINY_SFT, "--model_name_or_path", model_without_weights, "--dataset_name", str(data), option, split]
    args += ["--output_dir", str(tmp_path / "out")]
    for extra in (["--dry_run"], []):  # the plan and the run itself
        assert main([*args, *extra]) == 1
        err = capsys.readouterr().err
        assert f"  - {option[2:]}='{split}': {data}: split '{split}' cannot apply: a single .jsonl file" in err
        assert "Traceback" not in err


def test_data_errors_come_before_the_model_and_name_the_line(tmp_path, model_without_weights, capsys):
    data = tmp_path / "sft.jsonl"
    write_longrm_jsonl(data, 5, sft=True)
    lines = data.read_text().splitlines()
    bad = json.loads(lines[3])
    bad["chat_template"][1]["role"] = "oracle"
    data.write_text("\n".join([*lines[:3], "", json.dumps(bad), lines[4]]) + "\n")  # row 3 is on line 5
    args = [TINY_SFT, "--model_name_or_path", model_without_weights, "--dataset_name", str(data)]
    assert main([*args, "--output_dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    [error] = errors_of(err)
    assert error.startswith(f"trl-longrm: error: {data}, line 5, key 'chat_template[1].role': unknown role 'oracle'")


@pytest.mark.parametrize(
    "truncation,max_length,reason,advice",
    [
        ("drop", 24, "longer than max_length with truncation='drop'", "--truncation truncate_prompt"),
        ("truncate_prompt", 8, "responses alone fill max_length", "Raise --max_length: it must hold"),
    ],
)
def test_every_row_dropped_says_how_many_why_and_what_to_change(
    tmp_path, model_without_weights, capsys, truncation, max_length, reason, advice
):
    data = write_longrm_jsonl(tmp_path / "sft.jsonl", 6, sft=True)
    args = [TINY_SFT, "--model_name_or_path", model_without_weights, "--dataset_name", str(data)]
    args += ["--truncation", truncation, "--max_length", str(max_length), "--output_dir", str(tmp_path / "out")]
    assert main(args) == 1
    [error] = errors_of(capsys.readouterr().err)
    assert error.startswith(
        f"trl-longrm: error: {data}: every row was dropped, none is left to train on: of 6 rows, 6 "
    )
    assert reason in error and f"(max_length={max_length} tokens)" in error and advice in error


def test_empty_file_is_reported_by_the_dry_run(tmp_path, model_without_weights, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert (
        main([TINY_GRM, "--dry_run", "--model_name_or_path", model_without_weights, "--dataset_name", str(empty)]) == 1
    )
    assert f"  - dataset_name='{empty}': the file is empty" in capsys.readouterr().err


def test_launcher_checks_paths_once_before_launching(tmp_path, monkeypatch, capsys):
    # `trl-longrm train` through its `main` in this process (an exception escaping it would be the traceback).
    from trl_longrm.cli import main as trl_longrm

    monkeypatch.chdir(tmp_path)
    code = trl_longrm(["train", TINY_SFT, "--dataset_name", "./nope.jsonl", "--output_dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 1 and "Launching" not in out
    assert errors_of(err) == ["trl-longrm: error: the run cannot start:"]
    assert f"  - dataset_name='./nope.jsonl': no such file or folder (resolved against {tmp_path})" in err
    # The tiny recipe's model is relative (demo_outputs/...) and absent here: reported as a missing path too.
    assert "  - model_name_or_path='demo_outputs/models/judge-from-disrm': no such file or folder" in err


@pytest.mark.parametrize("where", ["flag", "recipe"])
def test_report_to_all_without_a_tracker_says_so(tmp_path, model_without_weights, capsys, where):
    from transformers.integrations import get_available_reporting_integrations

    data = write_longrm_jsonl(tmp_path / "sft.jsonl", 2, sft=True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        Path(TINY_SFT)
        .read_text()
        .replace("report_to: none", "report_to: all" if where == "recipe" else "report_to: none")
    )
    args = [str(recipe), "--dry_run", "--model_name_or_path", model_without_weights, "--dataset_name", str(data)]
    assert main([*args, *(["--report_to", "all"] if where == "flag" else [])]) == 0
    said = "note: report_to=all: no tracker is installed" in capsys.readouterr().err
    assert said == (get_available_reporting_integrations() == [])
    assert main([*args, "--report_to", "none"]) == 0
    assert "report_to" not in capsys.readouterr().err


def test_disrm_lora_config_lists_the_score_head_once(tmp_path):
    """PEFT's SEQ_CLS task puts the score head in `modules_to_save`; the saved adapter config names it once (it
    listed `["score", "classifier", "score"]`), and the head trains."""
    from peft import get_peft_model
    from trl import ModelConfig

    from trl_longrm.testing_utils import build_tiny_model
    from trl_longrm.train import peft_config_for

    for user_modules in (None, ["score"]):
        args = ModelConfig(use_peft=True, lora_target_modules=["q_proj", "v_proj"], lora_modules_to_save=user_modules)
        model = get_peft_model(build_tiny_model(task="seq-cls"), peft_config_for("simpo_disrm", args))
        model.save_pretrained(tmp_path / "adapter")
        saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["modules_to_save"]
        assert "score" in saved and len(saved) == len(set(saved)), saved
        assert any("score" in n and p.requires_grad for n, p in model.named_parameters())
