"""What the benchmark scripts share: the model and data builders, the four trainers (ours and stock TRL) on the same
pre-tokenised groups, step timing, and memory readings.

Models are small (a few layers, hidden 256) but keep a realistic 151,936-token vocabulary (Qwen's), so that the
`[tokens, vocab]` logits of a stock LM head weigh what they weigh on a real model. Data are random token ids: one
preference group per step, a long prompt shared by the chosen and the one rejected response (k = 1, so that stock TRL
can train it), and short responses of different lengths (so that the stock padded batches carry a little padding).
"""

from __future__ import annotations

import os


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import platform  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from transformers import TrainerCallback  # noqa: E402


# Qwen's vocabulary: the logits of a stock LM head are `tokens x 151936` floats (0.6 MB per token in fp32).
VOCAB_SIZE = 151_936
MODEL_OVERRIDES = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
ARCH = "qwen3"
TRAINERS = ("grm", "disrm")
IMPLS = ("ours", "stock")
STOCK_NAME = {"grm": "trl.experimental.cpo.CPOTrainer (simpo, cpo_alpha=0)", "disrm": "trl.RewardTrainer"}
OURS_NAME = {"grm": "trl_longrm.SimPOGRMTrainer", "disrm": "trl_longrm.SimPODisRMTrainer"}


def maxrss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fix_mmap_threshold(threshold_bytes: int) -> None:
    """Serve every allocation of at least `threshold_bytes` by its own mmap, returned to the system when freed.

    glibc starts at a 128 KiB mmap threshold but raises it (up to 32 MiB) each time a mmapped block is freed; from then
    on tensors under 32 MiB come from the heap, whose freed memory mostly stays resident. The peak RSS then counts
    fragmentation as well as live tensors, and more so for a run whose activations are small (a shared-prefix row's
    are a fifth of the unshared row's, so they fall under the raised threshold where the unshared ones do not).
    Fixing the threshold (`mallopt(M_MMAP_THRESHOLD)`, which also stops the raising) makes the peak RSS follow the
    live tensors in both. No-op where the C library is not glibc.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, int(threshold_bytes))


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def software_versions() -> dict[str, str]:
    import datasets
    import torch
    import transformers
    import trl

    import trl_longrm

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "datasets": datasets.__version__,
        "trl_longrm": trl_longrm.__version__,
    }


def machine_description() -> dict[str, object]:
    import torch

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(total / 2**30, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


# ---------------------------------------------------------------------------------------------------- data


def random_groups(num_groups: int, prompt_length: int, response_length: int, eos_token_id: int, seed: int = 0,
                  warmup_prompt_length: int | None = None, warmup_steps: int = 1, num_rejected: int = 1,
                  vocab_size: int = VOCAB_SIZE):
    """`num_groups` tokenised preference groups (`num_rejected` rejected responses, k = 1 by default: stock TRL's
    formats) as python lists.

    Every prompt has exactly `prompt_length` tokens, except the first `warmup_steps` ones' when `warmup_prompt_length`
    is given: the warm-up steps (the first allocates the gradients and the optimizer state; none is timed) then train
    short rows, so that the peak RSS after them is the floor that does not depend on the row length. Each response has between
    `response_length // 2` and `response_length` tokens, the last being EOS (stock CPO would append it otherwise).
    Token ids are drawn from the whole vocabulary (`vocab_size`: the model's) except the first 3 (the fixture
    tokenizer's special tokens).
    """
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    def response():
        return ids(rng.randint(response_length // 2, response_length) - 1) + [eos_token_id]

    lengths = [prompt_length] * num_groups
    if warmup_prompt_length is not None:
        lengths[:warmup_steps] = [warmup_prompt_length] * warmup_steps
    return [
        {"prompt_ids": ids(n), "chosen_completion_ids": response(),
         "rejected_completion_ids": [response() for _ in range(num_rejected)]}
        for n in lengths
    ]


def group_tokens(group: dict) -> int:
    """Real tokens a group trains on: the prompt once per response, plus the responses (no padding)."""
    responses = [group["chosen_completion_ids"], *group["rejected_completion_ids"]]
    return len(group["prompt_ids"]) * len(responses) + sum(len(r) for r in responses)


def stock_cpo_rows(groups: list[dict]) -> list[dict]:
    """The columns stock `CPOTrainer.tokenize_row` produces from text, built from token ids instead (labels -100 on
    the prompt), so that stock CPO trains exactly the tokens ours does."""
    rows = []
    for group in groups:
        prompt = list(group["prompt_ids"])
        row = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
        for name, completion in (
            ("chosen", group["chosen_completion_ids"]),
            ("rejected", group["rejected_completion_ids"][0]),
        ):
            ids = prompt + list(completion)
            row[f"{name}_input_ids"] = ids
            row[f"{name}_attention_mask"] = [1] * len(ids)
            row[f"{name}_labels"] = [-100] * len(prompt) + list(completion)
        rows.append(row)
    return rows


def stock_reward_rows(groups: list[dict]) -> list[dict]:
    """Pre-tokenised rows of stock `RewardTrainer` (`chosen_ids` / `rejected_ids`: it then skips tokenisation)."""
    return [
        {
            "chosen_ids": list(g["prompt_ids"]) + list(g["chosen_completion_ids"]),
            "rejected_ids": list(g["prompt_ids"]) + list(g["rejected_completion_ids"][0]),
        }
        for g in groups
    ]


# ---------------------------------------------------------------------------------------------------- trainers


def base_args(output_dir: str, steps: int, **overrides) -> dict:
    """Training arguments shared by all four trainers. Everything else (gradient checkpointing on, fused AdamW,
    max_grad_norm 1.0, fp32 on CPU) is each config's own default, the same for all four."""
    args = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=1,  # one preference group (chosen + 1 rejected) per step
        max_steps=steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",
        seed=0,
    )
    args.update(overrides)
    return args


def build_model(task: str, tokenizer, seed: int = 0):
    from trl_longrm.testing_utils import build_tiny_model

    return build_tiny_model(ARCH, task, tokenizer, seed=seed, **MODEL_OVERRIDES)


def build_trainer(trainer: str, impl: str, model, tokenizer, groups: list[dict], output_dir: str, steps: int,
                  callbacks=(), peft_config=None, **overrides):
    """One of the four trainers on `groups`: `trainer` in ('grm', 'disrm'), `impl` in ('ours', 'stock'); with
    `peft_config`, the trainer wraps the model in that adapter (as TRL trainers do)."""
    from transformers import PrinterCallback

    instance = _build_trainer(trainer, impl, model, tokenizer, groups, output_dir, steps, callbacks, peft_config,
                              **overrides)
    instance.remove_callback(PrinterCallback)  # the final metrics dict of every run would clutter the output
    return instance


def _build_trainer(trainer, impl, model, tokenizer, groups, output_dir, steps, callbacks, peft_config, **overrides):
    from datasets import Dataset

    max_length = max(group_tokens(g) for g in groups)  # no truncation, no filtering: every token is trained
    args = base_args(output_dir, steps, max_length=max_length, **overrides)
    callbacks = list(callbacks)
    if trainer == "grm" and impl == "ours":
        from trl_longrm import SimPOGRMConfig, SimPOGRMTrainer

        config = SimPOGRMConfig(nll_loss_weight=0.0, **args)  # cpo_alpha=0, as the stock run
        return SimPOGRMTrainer(model=model, args=config, train_dataset=Dataset.from_list(groups),
                               processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)
    if trainer == "grm" and impl == "stock":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        class PretokenisedCPOTrainer(CPOTrainer):
            # The rows already hold what `tokenize_row` makes of text; the training path is stock.
            def tokenize_row(self, feature, model=None):
                return feature

        # remove_unused_columns=False: what CPOTrainer sets itself for its collator (with a warning).
        config = CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=2.5, simpo_gamma=0.5, remove_unused_columns=False,
                           **args)
        return PretokenisedCPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(stock_cpo_rows(groups)),
                                      processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)
    if trainer == "disrm" and impl == "ours":
        from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer

        config = SimPODisRMConfig(**args)
        return SimPODisRMTrainer(model=model, args=config, train_dataset=Dataset.from_list(groups),
                                 processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)
    if trainer == "disrm" and impl == "stock":
        from trl import RewardConfig, RewardTrainer

        config = RewardConfig(**args)
        return RewardTrainer(model=model, args=config, train_dataset=Dataset.from_list(stock_reward_rows(groups)),
                             processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)
    raise ValueError(f"unknown trainer {trainer!r} / impl {impl!r}")


@dataclass
class StepTimer(TrainerCallback):
    """Wall time of every optimizer step (forward, backward, optimizer) and the peak RSS after it."""

    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    maxrss: list[int] = field(default_factory=list)
    _start: tuple[float, float] = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        # CPU seconds / wall seconds of a step: about the thread count on an idle machine, less when another
        # process takes cores from us (the benchmark records it to show how noisy each timing was).
        self.times.append(time.perf_counter() - self._start[0])
        self.cpu_times.append(time.process_time() - self._start[1])
        self.maxrss.append(maxrss_bytes())
