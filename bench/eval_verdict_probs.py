"""Evaluation time per record of a generative judge: verdict probabilities from the generation pass (now) against a
second forced-decoding forward over the whole prompt (before), side by side in one run, on ~4K-token records.

The judge is a random Qwen3-shaped model (8 layers, width 512, vocabulary 32K; `--layers`, `--width`) steered to write
a judgment of `--judgment-tokens` tokens ending with `[[` (`trl_longrm.testing_utils.steer_generation`), so both
paths read a real verdict position after real forward passes. "before" is the same judge with the generation-pass
reading switched off (every verdict goes through the forced pass, as the judge did before). The two are timed in
alternation on the same records (ABAB...), after one warm-up record each, and their verdict probabilities are
compared.

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/eval_verdict_probs.py --out bench/results/eval

Prints one JSON line: seconds per record before and after, their ratio, and the largest probability difference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from trl_longrm.evaluation import GenerativeJudge, JudgeRequest
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model, steer_generation


class ForcedPassJudge(GenerativeJudge):
    """The judge as it was: every verdict probability from a second, forced-decoding forward."""

    def _probs_at_verdict(self, tokens, text, step_logits):
        return None


def make_requests(tokenizer, n: int, prompt_tokens: int) -> list[JudgeRequest]:
    filler = "The report lists the capital, the language and the price of each item in the region. "
    # Tokens per sentence inside a long run of them (merges across sentence boundaries included).
    per_sentence = len(tokenizer(filler * 100, add_special_tokens=False)["input_ids"]) / 100
    requests = []
    for i in range(n):
        document = filler * int(prompt_tokens / per_sentence) + f"The key number of item {i} is {10 + i}."
        requests.append(
            JudgeRequest(
                record_id=f"bench/{i}",
                prompt_messages=[],
                task_prompt=f"{document}\n\nQuestion: what is the key number of item {i}?",
                responses=[f"It is {10 + i}.", f"It is {11 + i}."],
                ranking=False,
            )
        )
    return requests


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--judgment-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--out", default=None, help="Directory for eval_verdict_probs.json (default: print only).")
    args = parser.parse_args(argv)

    tokenizer = build_chat_tokenizer()
    model = build_tiny_model(
        "qwen3",
        "causal-lm",
        tokenizer,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.width // 8,
        vocab_size=32768,  # a real vocabulary's LM-head cost; the tokenizer uses the first 512 ids
    ).eval()
    # A judgment of about --judgment-tokens tokens ending with the verdict opening, tokenised as a whole (so that the
    # forced pass, which re-tokenises the text, sees the same context as the generation).
    sentence = " The document supports the first response."
    repeats = max(1, args.judgment_tokens // len(tokenizer(sentence, add_special_tokens=False)["input_ids"]))
    judgment = "The first response quotes the document." + sentence * (repeats - 1) + "\n[["
    script = tokenizer(judgment, add_special_tokens=False)["input_ids"]
    steer_generation(model, script)
    kwargs = dict(max_length=args.prompt_tokens + 1024, max_new_tokens=len(script) + 3)
    judges = {"after": GenerativeJudge(model, tokenizer, **kwargs), "before": ForcedPassJudge(model, tokenizer, **kwargs)}
    requests = make_requests(tokenizer, args.records + 1, args.prompt_tokens)
    prompt_lengths = [len(judges["after"]._prompt_ids(judges["after"].template.pairwise_messages(r.task_prompt, r.responses))[0]) for r in requests]

    times = {name: [] for name in judges}
    probs = {name: [] for name in judges}
    for index, request in enumerate(requests):
        for name in (("after", "before") if index % 2 == 0 else ("before", "after")):
            start = time.perf_counter()
            [output] = judges[name].judge([request])
            elapsed = time.perf_counter() - start
            if index > 0:  # the first record warms both up
                times[name].append(elapsed)
                probs[name].append(output.verdict_probs)
            assert output.text.endswith("]]") or "[[" in output.text, output.text
    diff = max(abs(a - b) for pa, pb in zip(probs["after"], probs["before"]) for a, b in zip(pa, pb))
    result = {
        "seconds_per_record_before": round(statistics.median(times["before"]), 3),
        "seconds_per_record_after": round(statistics.median(times["after"]), 3),
        "after_over_before": round(statistics.median(times["after"]) / statistics.median(times["before"]), 3),
        "max_verdict_prob_difference": diff,
        "records_timed": args.records,
        "prompt_tokens_median": int(statistics.median(prompt_lengths)),
        "judgment_tokens": len(script) + 1,
        "model": f"qwen3 random, {args.layers} layers, width {args.width}, vocab 32768",
        "threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
        "command": " ".join([os.path.relpath(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])]),
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "eval_verdict_probs.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
