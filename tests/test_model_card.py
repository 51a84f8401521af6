"""The model card saved with a DisRM: base model, data, the LongRM citation, and a scoring snippet that, run as written
on the saved checkpoint, gives our evaluator's scores."""

from __future__ import annotations

import re

import pytest
from datasets import Dataset
from test_scoring_convention import template_tokenizer
from trainer_helpers import cpu_args

from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer
from trl_longrm.evaluation.judges import DiscriminativeJudge, JudgeRequest
from trl_longrm.testing_utils import save_tiny_model


@pytest.mark.parametrize("template", ["chatml", "ends_at_eos_pad_is_eos"])
def test_card_snippet_scores_as_the_evaluator(tmp_path, template):
    base = save_tiny_model(tmp_path / "base", task="seq-cls", tokenizer=template_tokenizer(template), seed=4)
    rows = [{"prompt": [{"role": "user", "content": "Which city?"}], "chosen": "The river city.", "rejected": ["No."]}]
    trainer = SimPODisRMTrainer(model=base, args=SimPODisRMConfig(**cpu_args(tmp_path / "run", max_steps=1)),
                                train_dataset=Dataset.from_list(rows * 2))  # fmt: skip
    trainer.set_dataset_name("my_org/long_prefs")
    trainer.train()
    saved = tmp_path / "disrm"
    trainer.save_model(str(saved))
    card = (saved / "README.md").read_text()
    assert f"Base model: {base}" in card and "Training data: my_org/long_prefs" in card
    assert "datasets:\n- my_org/long_prefs" in card and "base_model:" not in card  # a local base is no Hub id
    assert "arXiv:2510.06915" in card and "Tang, Zecheng" in card and "SimPODisRMTrainer" in card
    # Where GRPO's plain-text reading differs from training's (`tests/test_scoring_convention.py` checks the claim).
    assert f"LongRMReward({str(saved)!r}, as_trained=True)` reads the trained token" in card
    snippet = re.search(r"```python\n(.*?)```", card, flags=re.DOTALL).group(1)
    assert repr(str(saved)) in snippet
    namespace = {}
    exec(compile(snippet, "model card snippet", "exec"), namespace)  # noqa: S102 - our own generated card
    judge = DiscriminativeJudge.from_pretrained(str(saved), device="cpu")
    [expected] = judge.judge([JudgeRequest("x/0", namespace["prompt"], "task", namespace["responses"], ranking=False)])
    assert namespace["scores"] == pytest.approx(expected.scores, abs=1e-4)
    assert abs(namespace["scores"][0] - namespace["scores"][1]) > 1e-4
