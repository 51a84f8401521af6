"""The model card written with a trained DisRM: what it is, what it was trained from and on, and how to score with it."""

from __future__ import annotations

import os

import yaml


LONGRM_CITATION = """@article{tang2025longrm,
  title   = {{LongRM}: Revealing and Unlocking the Context Boundary of Reward Modeling},
  author  = {Tang, Zecheng and Ji, Baibei and Qiu, Quantong and Wang, Haitian and Liang, Xiaobo and Li, Juntao and
             Zhang, Min},
  journal = {arXiv preprint arXiv:2510.06915},
  year    = {2025}
}"""

SCORING_SNIPPET = '''import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

model_id = {model_id!r}
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForSequenceClassification.from_pretrained(model_id).eval()

prompt = [{{"role": "user", "content": "Which river runs through the city in the document?"}}]
responses = ["The document names the long river of the city.", "No river is mentioned."]
# Each conversation as the chat template renders it; the score is read at its last token (the pad token is not the
# EOS token, so the model's pooling finds it with any padding side).
texts = [tokenizer.apply_chat_template(prompt + [{{"role": "assistant", "content": r}}], tokenize=False)
         for r in responses]
batch = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
with torch.no_grad():
    scores = model(**batch).logits[:, 0].tolist()
print(scores)  # higher is better
'''


def disrm_model_card(
    model_id: str,
    base_model: str | None,
    dataset_name: str | None,
    trainer_name: str = "SimPODisRMTrainer",
    tags: list[str] | None = None,
) -> str:
    """The README.md of a DisRM checkpoint: front matter (base model when it is a Hub id, library, tags, datasets),
    what it was trained from and on, a scoring snippet correct for this checkpoint (`SCORING_SNIPPET`, run by
    `tests/test_model_card.py`), its use as a GRPO/RLOO reward, and the LongRM citation.

    Example:
    ```python
    >>> card = disrm_model_card("me/my-disrm", "Qwen/Qwen3-8B", "longrm_simpo")
    ```
    """
    hub_base = base_model if base_model and not os.path.isdir(base_model) else None
    front = {"library_name": "transformers", "pipeline_tag": "text-classification",
             "tags": sorted({"trl", "trl-longrm", "reward-model", "long-context", *(tags or [])})}  # fmt: skip
    if hub_base:
        front["base_model"] = hub_base
    if dataset_name and not os.path.exists(dataset_name):
        front["datasets"] = [dataset_name]
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=True).rstrip(),
        "---",
        "",
        f"# {os.path.basename(model_id.rstrip('/')) or model_id}",
        "",
        "A long-context discriminative reward model (one score per conversation), trained with "
        f"`trl_longrm.{trainer_name}` (Bradley-Terry over each prompt's chosen and rejected responses, following "
        "LongRM, arXiv 2510.06915).",
        "",
        f"- Base model: {base_model or 'not recorded'}",
        f"- Training data: {dataset_name or 'not recorded'}",
        "",
        "## Scoring",
        "",
        "The score of a conversation is the classification head at the **last token of the conversation as the chat "
        "template renders it** (ChatML's newline after `<|im_end|>` included), the token transformers' "
        "sequence-classification pooling, TRL's `RewardTrainer` and `GRPOTrainer` read. Its tokenizer's pad token is "
        "not its EOS token, so that pooling finds that token.",
        "",
        "```python",
        SCORING_SNIPPET.format(model_id=model_id).rstrip(),
        "```",
        "",
        "As a reward for online RL: `GRPOTrainer(reward_funcs=" + repr(model_id) + ", ...)` reads the same scores "
        "of conversations; `trl_longrm.LongRMReward(" + repr(model_id) + ")` gives them with each prompt encoded once "
        "for all of its completions.",
        "",
        "Plain-text (not chat) prompts are scored in training, and by `trl-longrm score` and `trl-longrm eval`, as "
        "the prompt (with the tokenizer's special tokens), the response, then an EOS, read at that EOS. `GRPOTrainer` "
        "scores the text prompt + completion, tokenized as one without special tokens and without the EOS (it decodes "
        "the completion without special tokens), so it reads the token before: another score. `LongRMReward` does as "
        "`GRPOTrainer` by default; `LongRMReward(" + repr(model_id) + ", as_trained=True)` reads the trained token.",
        "",
        "## Citation",
        "",
        "```bibtex",
        LONGRM_CITATION,
        "```",
        "",
    ]
    return "\n".join(lines)
