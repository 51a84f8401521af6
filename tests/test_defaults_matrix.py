"""TRL's defaults and mixed precision, as a TRL user constructs each trainer.

Every config gets only `output_dir` and `use_cpu` (this machine has no GPU) plus the factor under test and
`max_steps=2, logging_steps=1`, so TRL's defaults apply (`bf16=True` autocast, gradient checkpointing, 8 rows per
batch) and ours (`shared_prefix`, `padding_free`). Six two-level factors per trainer:

    A checkpoint dtype (float32 / bfloat16, saved as TRL's generator scripts save its tiny models)
    B bf16 autocast (TRL's default on / off)
    C layout (GRM, DisRM: `shared_prefix` on / off; SFT: `packing` on / off)
    D = A xor B gradient checkpointing, E = A xor C LoRA, F = B xor C model given by path / as an instance

A, B, C run their full product (the crash this guards against needed float32 weights, autocast and shared
prefixes together) and D, E, F are the 2^(6-3) fractional factorial's columns, so every pair of the six factors
meets in all four combinations. Each case trains two steps with finite losses, and its first-step loss matches the
stock TRL trainer run on the same rows with the same factors (the stock trainer has no layout factor): float32 (A and
B off) within 1e-5 relative; otherwise within the deviation stock itself shows between its runs in that precision
and its runs of the same weights in float32 without autocast (see the test).
Qwen3 is the architecture: its q/k norms return float32 under autocast on float32 weights. The chat template is
ChatML's (a newline after `<|im_end|>`) for SFT and DisRM; SimPO-GRM's template ends the assistant turn at its EOS,
because on ChatML its sequences differ from CPOTrainer's by design (`test_preference_sequences_as_stock_or_at_the_eos`).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
from trl import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer

from trl_longrm import (
    LongSFTConfig,
    LongSFTTrainer,
    SimPODisRMConfig,
    SimPODisRMTrainer,
    SimPOGRMConfig,
    SimPOGRMTrainer,
)
from trl_longrm.testing_utils import build_tiny_model


WORDS = "the city river number name year color animal planet capital author book price height".split()
NUM_ROWS = 8  # TRL's default per_device_train_batch_size: one optimizer step per epoch


def _sentence(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def preference_rows(seed=0):
    """TRL's conversational preference format, one rejected response (so that the stock trainers can take it)."""
    rng = random.Random(seed)
    return [
        {
            "prompt": [{"role": "user", "content": _sentence(rng, 12, 40)}],
            "chosen": [{"role": "assistant", "content": _sentence(rng, 2, 8)}],
            "rejected": [{"role": "assistant", "content": _sentence(rng, 2, 8)}],
        }
        for _ in range(NUM_ROWS)
    ]


def sft_rows(seed=0):
    """TRL's conversational prompt/completion format (both trainers train the completion only)."""
    return [{"prompt": row["prompt"], "completion": row["chosen"]} for row in preference_rows(seed)]


CASES = [
    dict(
        checkpoint=("float32", "bfloat16")[a],
        autocast=(True, False)[b],
        layout_on=(True, False)[c],
        gradient_checkpointing=(True, False)[a ^ b],
        lora=bool(a ^ c),
        given_as=("path", "instance")[b ^ c],
    )
    for a, b, c in itertools.product((0, 1), repeat=3)
]


def case_id(case):
    return "-".join(
        [
            case["checkpoint"][:4],
            "autocast" if case["autocast"] else "noautocast",
            "layout" if case["layout_on"] else "nolayout",
            "gc" if case["gradient_checkpointing"] else "nogc",
            "lora" if case["lora"] else "full",
            case["given_as"],
        ]
    )


def test_cases_cover_every_pair_of_factors():
    """The design's own property: every pair of the six factors meets in all four level combinations."""
    levels = [
        [c["checkpoint"] == "bfloat16", c["autocast"], c["layout_on"], c["gradient_checkpointing"], c["lora"],
         c["given_as"] == "path"]
        for c in CASES
    ]  # fmt: skip
    for i, j in itertools.combinations(range(6), 2):
        assert {(row[i], row[j]) for row in levels} == {(x, y) for x in (False, True) for y in (False, True)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    """Tiny Qwen3 checkpoints, float32 and bfloat16 (TRL's generator scripts call `.to(dtype=torch.bfloat16)`)."""
    root = tmp_path_factory.mktemp("defaults_matrix_models")
    paths = {}
    for task in ("causal-lm", "seq-cls"):
        for dtype in ("float32", "bfloat16"):
            model = build_tiny_model("qwen3", task, tokenizer, seed=0).to(dtype=getattr(torch, dtype))
            path = root / f"{task}-{dtype}"
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            paths[task, dtype] = str(path)
    return paths


class LossLog(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


KIND = {
    "grm": ("causal-lm", AutoModelForCausalLM, "CAUSAL_LM"),
    "disrm": ("seq-cls", AutoModelForSequenceClassification, "SEQ_CLS"),
    "sft": ("causal-lm", AutoModelForCausalLM, "CAUSAL_LM"),
}


def ending_at_eos(tokenizer):
    """The tokenizer with a ChatML template whose assistant turn ends at its EOS (no newline after it)."""
    import copy

    ends = copy.deepcopy(tokenizer)
    ends.chat_template = tokenizer.chat_template.replace("{% endgeneration %}{{ '\\n' }}", "{% endgeneration %}")
    assert ends.chat_template != tokenizer.chat_template
    return ends


def train(kind, impl, case, checkpoints, tokenizer, output_dir, float32_weights=False, seed=0, **extra):
    """Two steps of one trainer on one case (rows drawn with `seed`); returns the logged losses. `float32_weights`:
    the checkpoint's weights loaded in float32 (an instance), the reference a bfloat16 case is measured against."""
    task, auto_class, task_type = KIND[kind]
    path = checkpoints[task, case["checkpoint"]]
    model = path if case["given_as"] == "path" else auto_class.from_pretrained(path)
    if float32_weights:
        model = auto_class.from_pretrained(path, dtype=torch.float32)
    args = dict(output_dir=str(output_dir), use_cpu=True, max_steps=2, logging_steps=1, report_to=[], **extra)
    if not case["autocast"]:
        args["bf16"] = False
    if not case["gradient_checkpointing"]:
        args["gradient_checkpointing"] = False
    peft_config = None
    if case["lora"]:
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type=task_type)
    log = LossLog()
    if kind == "grm":  # see the module docstring
        tokenizer = ending_at_eos(tokenizer)
    if kind == "grm":
        dataset = Dataset.from_list(preference_rows(seed))
        if impl == "ours":
            config = SimPOGRMConfig(shared_prefix=case["layout_on"], **args)
            cls = SimPOGRMTrainer
        else:  # the loss our defaults give (LongRM's SimPO): CPO's simpo with the same beta, gamma and NLL weight
            config = CPOConfig(loss_type="simpo", beta=2.5, simpo_gamma=0.5, cpo_alpha=0.05, **args)
            cls = CPOTrainer
    elif kind == "disrm":
        dataset = Dataset.from_list(preference_rows(seed))
        if impl == "ours":
            config, cls = SimPODisRMConfig(shared_prefix=case["layout_on"], **args), SimPODisRMTrainer
        else:
            config, cls = RewardConfig(**args), RewardTrainer
    else:
        dataset = Dataset.from_list(sft_rows(seed))
        if impl == "ours":
            config, cls = LongSFTConfig(packing=case["layout_on"], **args), LongSFTTrainer
        else:
            config, cls = SFTConfig(**args), SFTTrainer
    trainer = cls(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[log],
                  peft_config=peft_config)  # fmt: skip
    if impl == "ours":  # TRL's defaults really apply (nothing above set them)
        assert trainer.args.bf16 is case["autocast"]
        assert trainer.args.gradient_checkpointing is case["gradient_checkpointing"]
    trainer.train()
    assert len(log.losses) == 2 and all(math.isfinite(x) for x in log.losses), log.losses
    return log.losses


_STOCK: dict = {}
_EXACT: dict = {}
NOISE_SEEDS = (0, 1, 2)


def stock_first_loss(kind, case, checkpoints, tokenizer, tmp_path, seed=0):
    """Stock's first-step loss on the case, and on the same weights in float32 without autocast (its exact value)."""
    key = (kind, seed, *(v for k, v in sorted(case.items()) if k != "layout_on"))
    if key not in _STOCK:
        loss = train(kind, "stock", case, checkpoints, tokenizer, tmp_path / "stock", seed=seed)[0]
        # The exact value depends on the weights and the rows only: the float32 run loads the checkpoint as an instance
        # whatever `given_as`, gradient checkpointing recomputes the same forward, and a fresh LoRA adapter adds
        # exact zeros (lora_B is zero-initialised, no dropout). So one float32 run per checkpoint, seed and trainer
        # serves every case that shares them (the matrix's slowest part was these repeated runs).
        exact_key = (kind, seed, case["checkpoint"])
        if exact_key not in _EXACT:
            plain = {**case, "autocast": False, "gradient_checkpointing": False, "lora": False}
            _EXACT[exact_key] = train(kind, "stock", plain, checkpoints, tokenizer, tmp_path / "stock_fp32",
                                      float32_weights=True, seed=seed)[0]  # fmt: skip
        _STOCK[key] = loss, _EXACT[exact_key]
    return _STOCK[key]


def stock_bf16_deviation(kind, case, checkpoints, tokenizer, tmp_path):
    """The largest relative deviation of stock's first-step loss from its float32 run of the same weights, over
    three batches, in this case's precision (checkpoint dtype, autocast): bf16 rounding is noise, and one batch's
    deviation can be several times another's."""
    deviations = []
    for seed in NOISE_SEEDS:
        loss, exact = stock_first_loss(kind, case, checkpoints, tokenizer, tmp_path, seed)
        deviations.append(abs(loss - exact) / abs(exact))
    return max(deviations)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("kind", ["grm", "disrm", "sft"])
def test_trl_defaults_and_precision(kind, case, checkpoints, tokenizer, tmp_path):
    """Float32 (weights and compute): ours == stock within 1e-5 relative. With bfloat16 weights or autocast, stock's
    own relative deviation from its float32 run of the same weights (the largest over three batches), `e`, is the
    tolerance: ours is within 2e of that float32 value and within 3e of stock's bf16 value (both at least 1e-5)."""
    ours = train(kind, "ours", case, checkpoints, tokenizer, tmp_path / "ours")[0]
    stock, exact = stock_first_loss(kind, case, checkpoints, tokenizer, tmp_path)
    label = f"{kind} {case_id(case)}: first-step loss ours {ours:.7f}, stock {stock:.7f}, stock in float32 {exact:.7f}"
    if case["checkpoint"] == "float32" and not case["autocast"]:
        assert abs(ours - stock) <= 1e-5 * abs(stock), label
        return
    e = stock_bf16_deviation(kind, case, checkpoints, tokenizer, tmp_path)
    label += f", stock's bf16 deviation {e:.2e}"
    assert abs(ours - exact) <= (2 * e + 1e-5) * abs(exact), label
    assert abs(ours - stock) <= (3 * e + 1e-5) * abs(stock), label


def test_preference_sequences_as_stock_or_at_the_eos(tmp_path, tokenizer):
    """A DisRM's sequences are RewardTrainer's token for token, on ChatML too (the rendering's newline after
    `<|im_end|>` is where every consumer reads the score: `trl_longrm.scoring`). A generative judge's end at the
    response's EOS: with a template that ends the assistant turn there, CPOTrainer's token for token; on ChatML
    CPOTrainer's completion goes on with that newline and an EOS appended after it (`<|im_end|>`, newline,
    `<|im_end|>`: it teaches a judge to stop after a newline), and ours is stock's less those two tokens."""
    rows = preference_rows()
    causal = build_tiny_model("qwen3", "causal-lm", tokenizer, seed=0)
    classifier = build_tiny_model("qwen3", "seq-cls", tokenizer, seed=0)
    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    for template, chatml in ((tokenizer, True), (ending_at_eos(tokenizer), False)):
        data = Dataset.from_list(rows)
        stock = CPOTrainer(model=causal, args=CPOConfig(**args), train_dataset=data, processing_class=template)
        ours = SimPOGRMTrainer(model=causal, args=SimPOGRMConfig(**args), train_dataset=data, processing_class=template)
        for s, o in zip(stock.train_dataset, ours.train_dataset):
            for column in ("chosen_input_ids", "rejected_input_ids"):
                assert o[column] == s[column][: len(s[column]) - 2 * chatml]
                assert o[column][-1] == tokenizer.eos_token_id
            if chatml:
                assert tokenizer.decode(s["chosen_input_ids"][-3:]) == "<|im_end|>\n<|im_end|>"
        stock = RewardTrainer(model=classifier, args=RewardConfig(**args), train_dataset=data, processing_class=template)
        ours = SimPODisRMTrainer(model=classifier, args=SimPODisRMConfig(**args), train_dataset=data,
                                 processing_class=template)  # fmt: skip
        for s, o in zip(stock.train_dataset, ours.train_dataset):
            for column in ("chosen_ids", "rejected_ids"):
                assert o[column] == s[column]
                assert o[column][-1 - chatml] == tokenizer.eos_token_id
                assert not chatml or tokenizer.decode(o[column][-1:]) == "\n"
