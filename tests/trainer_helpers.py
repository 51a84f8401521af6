"""Shared builders for the trainer tests: tokenised preference groups and configs that run on CPU."""

import os
import random

from datasets import Dataset
from torch.utils._python_dispatch import TorchDispatchMode

from trl_longrm.memory.selective_checkpointing import is_attention_forward_op


# The device the trainer tests train on: CPU here and in CI; `TRL_LONGRM_TEST_DEVICE=cuda` runs the same comparisons
# (ours vs stock, packed vs padded, shared vs unshared) on a GPU machine.
TEST_DEVICE = os.environ.get("TRL_LONGRM_TEST_DEVICE", "cpu")


def cpu_args(output_dir, **overrides):
    """Arguments every TRL config needs on this CPU-only machine, plus quiet, deterministic defaults."""
    args = dict(
        output_dir=str(output_dir),
        use_cpu=TEST_DEVICE == "cpu",
        bf16=False,
        report_to=[],
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        disable_tqdm=True,
        save_strategy="no",
        dataloader_drop_last=False,
        seed=0,
    )
    args.update(overrides)
    return args


def random_groups(tokenizer, num_groups, num_rejected, seed=0, prompt_len=(8, 24), completion_len=(2, 9)):
    """Tokenised preference groups of random ordinary tokens, each completion ending with EOS."""
    rng = random.Random(seed)
    specials = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in specials]

    def ids(lo_hi):
        return [rng.choice(vocab) for _ in range(rng.randint(*lo_hi))]

    groups = []
    for _ in range(num_groups):
        k = num_rejected if isinstance(num_rejected, int) else rng.randint(*num_rejected)
        groups.append(
            {
                "prompt_ids": ids(prompt_len),
                "chosen_completion_ids": ids(completion_len) + [tokenizer.eos_token_id],
                "rejected_completion_ids": [ids(completion_len) + [tokenizer.eos_token_id] for _ in range(k)],
            }
        )
    return Dataset.from_list(groups)


def learnable_groups(tokenizer, num_groups, num_rejected, seed=0):
    """Groups whose chosen completion is always the same short judgment and whose rejected ones are random:
    a pattern a tiny model learns in a few steps."""
    groups = random_groups(tokenizer, num_groups, num_rejected, seed=seed).to_list()
    verdict = tokenizer("[[A]] [Score: 9]", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for group in groups:
        group["chosen_completion_ids"] = verdict
    return Dataset.from_list(groups)


_WORDS = "the city river number name year color animal planet capital author book price height".split()


def write_longrm_jsonl(path, num_rows, num_rejected=2, seed=0, sft=False):
    """Text data in the original LongRM format (`chat_template` + `chosen` + `rejects`, or `golden` for SFT) with a
    learnable pattern: the chosen judgment is always the same verdict."""
    import json

    rng = random.Random(seed)

    def sentence(n):
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(num_rows):
            row = {
                "chat_template": [
                    {"role": "system", "content": "You judge whether a response is consistent with the context."},
                    {"role": "user", "content": f"Context: {sentence(rng.randint(30, 60))}\nResponse: {sentence(8)}"},
                ]
            }
            if sft:
                row["golden"] = "[Analysis] consistent. [Score: 9]"
            else:
                row["chosen"] = "[Analysis] consistent. [Score: 9]"
                row["rejects"] = [sentence(rng.randint(3, 8)) for _ in range(num_rejected)]
            handle.write(json.dumps(row) + "\n")
    return str(path)


class AttentionCallCounter(TorchDispatchMode):
    """Counts the attention kernels' forward and backward ops run under it (`trl_longrm.memory.selective_checkpointing`'s
    definition of a forward op): under plain gradient checkpointing each forward runs twice per backward (the
    recompute), under selective checkpointing once."""

    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if is_attention_forward_op(func):
            self.forward += 1
            self.ops.add(name)
        elif ("attention" in name or "attn" in name) and ("backward" in name or "bwd" in name):
            self.backward += 1
            self.ops.add(name)
        return func(*args, **(kwargs or {}))
