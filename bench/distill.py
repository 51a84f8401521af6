"""Best-of-N self-distillation on the synthetic suite (issue 62; LongRM section 6.2): SFT of a policy on the rollouts
its reward model keeps against SFT on rollouts kept at random, scored on the suite's held-out questions.

The task: a document of the suite's facts (`trl_longrm.synthetic.world`) and a question about one key, answered in the
suite's fact sentence (`Record C02 holds the word such.`), the answer prefilled up to its word (`Record C02 holds the
word`: a prompt ending with an assistant turn, which the policy continues). The prefill spares the policy copying the
key's digits, which a 2-layer policy never learnt (5,000 SFT steps); the word must be found by reading the document.

The steps, each cached under `--work-dir` (a rerun resumes):
1. the reward model: the reduced demo's DisRM (`trl_longrm.demo`, trained by Bradley-Terry on the suite's judging
   data), fine-tuned on this task's answers (`--reward-rows` groups: the right sentence chosen, three sentences of words
   the document never states rejected). It learns what a model of its size can check: whether the answer's word is one
   the document states; another key's word (which only the lookup of the asked key exposes) it does not tell apart;
2. the policy: the demo judge's base (`--policy-base judge`: the DisRM's backbone under a new LM head, the demo's
   stand-in for a pretrained model that reads these documents), warmed up by SFT on right answers (`--warm-steps`)
   until its greedy answers mostly state a word of the document, while its samples at temperature 1 still mostly
   invent one (a fresh tiny Llama, `--policy-base fresh --policy-size 256x4`, does not get there in minutes);
3. `distill` (`trl_longrm.datagen.distill`, as `trl-longrm data distill` runs it): `--rollouts` samples of the policy
   per training prompt (training keys), scored by the reward model, the best kept; the random arm keeps one of the same
   rollouts at random (same prompts, same rollouts: only the choice differs);
4. SFT of the warmed policy on each arm's rows (same steps, same seed);
5. each policy answers held-out prompts (the world's eval keys, documents of the benchmark's lengths): greedy, and
   `--samples` samples at temperature 1. An answer is *right* when its word is the document's word for the key, and
   *stated* when its word is one the document states (right, or another key's: a faithful answer, LongRM's
   faithfulness perspective).

    .venv/bin/python bench/distill.py --out bench/results/distill.json

The table gives the shares of held-out answers that are right and stated, before and after; the margin is kept -
random. The rollouts' own shares (kept, random, any of each prompt's) are the reward model's selection.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def prompts(seed: str, count: int, split: str, tokens) -> list[dict]:
    """Prompts of the suite's form (system line, document, a question about one key), each with its answer's prefill
    (the key's fact sentence up to the word), the key's word and the full sentence."""
    from trl_longrm.demo import DEMO_DATA, demo_tokenizer
    from trl_longrm.synthetic.suite import SyntheticConfig, _TokenCounter, make_example
    from trl_longrm.synthetic.world import SURFACES, split_keys

    config = SyntheticConfig(**{k: v for k, v in DEMO_DATA.items() if k != "lengths"})
    counter, keys, rows = _TokenCounter(demo_tokenizer()), split_keys(split), []
    tasks = list(SURFACES)
    for index in range(count):
        rng = random.Random(f"{seed}:{index}")
        length = tokens(rng, index)
        task = tasks[index % len(tasks)]
        example = make_example(rng, task, keys, length, [0, 1], config, counter)
        (key,) = example.asked
        word = example.sheet.facts[key]
        sentence = SURFACES[task].fact_sentence(key, word)
        prefill = sentence[: sentence.rindex(f" {word}")]
        rows.append({"id": f"{seed}-{index}", "prompt": list(example.prompt_messages), "prefill": prefill,
                     "word": word, "sentence": sentence, "ctx_tokens": length})  # fmt: skip
    return rows


def prefilled(row: dict) -> list[dict]:
    return [*row["prompt"], {"role": "assistant", "content": row["prefill"]}]


def training_length(rng, _index) -> int:
    low, high = 20, 240  # the demo's training documents, log-uniform
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def absent_words(row: dict, count: int, rng: random.Random) -> list[str]:
    """`count` values (of the world's value words) that the row's document never states."""
    from trl_longrm.synthetic.world import VALUES

    stated = stated_words(row)
    return rng.sample([word for word in VALUES if word not in stated], count)


def stated_words(row: dict) -> set[str]:
    """The values the row's document states (the world's value words in its notes, not in its question)."""
    from trl_longrm.synthetic.world import VALUES

    document = row["prompt"][-1]["content"].split("\n\n# ")[0]
    return {word.strip(".,;:") for word in document.lower().split()} & set(VALUES)


def first_word(continuation: str) -> str:
    words = continuation.strip().lower().split()
    return words[0].strip(".,;:!?\"'") if words else ""


def is_right(row: dict, continuation: str) -> bool:
    """Whether a continuation of the prefill gives the key's word (its first word, without punctuation or case)."""
    return first_word(continuation) == row["word"]


def is_stated(row: dict, continuation: str) -> bool:
    """Whether a continuation gives a word the document states (right, or another key's word)."""
    return first_word(continuation) in stated_words(row)


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def train(recipe: str, model: Path, rows: Path, output_dir: Path, overrides: list[str]) -> Path:
    """`trl-longrm train recipes/tiny/RECIPE` on `rows` (as the demo trains its stages), unless already trained."""
    from unittest import mock

    from trl_longrm.cli import run_train_in_this_process
    from trl_longrm.demo import RECIPES

    if (output_dir / "training_complete").is_file():
        return output_dir
    argv = ["--model_name_or_path", str(model), "--dataset_name", str(rows), "--output_dir", str(output_dir),
            *overrides]  # fmt: skip
    with mock.patch.dict(os.environ, {"TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}):
        code = run_train_in_this_process(str(RECIPES / recipe), argv)
    if code:
        raise SystemExit(f"training into {output_dir} failed (exit code {code})")
    (output_dir / "training_complete").write_text("ok\n", encoding="utf-8")
    return output_dir


def sft(model: Path, rows: Path, output_dir: Path, steps: int, learning_rate: float, seed: int) -> Path:
    """SFT on prompt-completion rows (completion-only loss, TRL's default), rows drawn at random."""
    return train("sft.yaml", model, rows, output_dir,
                 ["--max_steps", str(steps), "--learning_rate", str(learning_rate), "--warmup_steps", "10",
                  "--train_sampling_strategy", "random", "--seed", str(seed), "--logging_steps", "50"])  # fmt: skip


def policy_base(tokenizer_path: Path, size: str, path: Path, seed: int) -> Path:
    """A fresh tiny Llama of `size` (`HIDDENxLAYERS`) on the tokenizer at `tokenizer_path` (seeded)."""
    from transformers import AutoTokenizer

    from trl_longrm.demo import DEMO_MODEL
    from trl_longrm.testing_utils import save_tiny_model

    if (path / "config.json").is_file():
        return path
    hidden, layers = (int(x) for x in size.split("x"))
    settings = dict(DEMO_MODEL, initializer_range=0.08)
    save_tiny_model(path, arch="llama", tokenizer=AutoTokenizer.from_pretrained(tokenizer_path), seed=seed,
                    hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden, **settings)  # fmt: skip
    return path


def completion(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def answer_all(model: Path, rows: list[dict], samples: int, seed: int) -> list[tuple[str, list[str]]]:
    """Each row's greedy continuation of its prefill and `samples` at temperature 1 (transformers, seeded per row)."""
    from trl_longrm.datagen.models import ModelSpec, build_chat_model
    from trl_longrm.datagen.steps import request_seed
    from trl_longrm.serving.sampling import Sampling

    spec = ModelSpec.from_dict({"name": "policy", "backend": "transformers", "model": str(model)}, "policy")
    policy, conversations = build_chat_model(spec), [prefilled(row) for row in rows]
    greedy = policy.answer(conversations, 4, [Sampling(n=1, temperature=0.0)] * len(rows))
    sampled = policy.answer(conversations, 4, [Sampling(n=samples, temperature=1.0,
                                                        seed=request_seed(seed, row["id"])) for row in rows])  # fmt: skip
    return [(g[0].text, [a.text for a in s]) for g, s in zip(greedy, sampled, strict=True)]


def score_policy(model: Path, rows: list[dict], samples: int, seed: int) -> dict:
    """Shares of held-out answers that are right and that state a word of the document, greedy and sampled."""
    answers = answer_all(model, rows, samples, seed)
    result = {}
    for name, check in (("right", is_right), ("stated", is_stated)):
        greedy = [check(row, g) for row, (g, _) in zip(rows, answers, strict=True)]
        sampled = [check(row, s) for row, (_, group) in zip(rows, answers, strict=True) for s in group]
        result[name] = {"greedy": sum(greedy) / len(greedy), "sampled": sum(sampled) / len(sampled)}
    result["example"] = {"prefill": rows[0]["prefill"], "greedy": answers[0][0], "sampled": answers[0][1],
                         "word": rows[0]["word"]}  # fmt: skip
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the results.")
    parser.add_argument("--work-dir", type=Path, default=None, help="Where the steps run (default: a temp dir).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy-size", default="256x4", help="The policy's hidden size x layers.")
    parser.add_argument(
        "--policy-base",
        choices=("fresh", "judge"),
        default="judge",
        help="fresh: a new tiny Llama of --policy-size; judge: the demo judge's base (the DisRM's "
        "backbone under a new LM head, the demo's stand-in for a pretrained model).",
    )
    parser.add_argument("--reward-rows", type=int, default=3000, help="Groups of the reward model's fine-tuning.")
    parser.add_argument("--warm-rows", type=int, default=6000, help="Rows of the policy's warm-up SFT.")
    parser.add_argument("--warm-steps", type=int, default=1600, help="Steps of the warm-up SFT (8 rows a step).")
    parser.add_argument("--warm-learning-rate", type=float, default=1e-3, help="Learning rate of the warm-up.")
    parser.add_argument("--prompts", type=int, default=2000, help="Training prompts distilled.")
    parser.add_argument("--rollouts", type=int, default=4, help="Rollouts per prompt (the paper: 2).")
    parser.add_argument("--steps", type=int, default=400, help="SFT steps on each arm's rows (8 rows a step).")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Learning rate of each arm's SFT.")
    parser.add_argument("--heldout", type=int, default=300, help="Held-out prompts (eval keys).")
    parser.add_argument("--samples", type=int, default=4, help="Samples per held-out prompt at temperature 1.")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from trl_longrm.cpu_threads import threads_per_process

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or threads_per_process(1)))
    from trl_longrm.data_demo import SMALL_DEMO
    from trl_longrm.datagen.distill import DistillConfig, distill
    from trl_longrm.demo import Demo, DemoConfig

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="distill_"))
    timings, start = {}, time.perf_counter()

    def lap(name):
        timings[name] = round(time.perf_counter() - start - sum(timings.values()), 1)

    # 1. The reward model: the reduced demo's DisRM (its judge's tokenizer is the policy's), fine-tuned by Bradley-Terry
    # on this bench's answers: the right sentence chosen, three sentences of words the document never states rejected.
    demo = Demo(DemoConfig(output_dir=str(work / "demo"), seed=args.seed, stages=["simpo_disrm"], **SMALL_DEMO))
    demo.run()
    demo.judge_base()
    rng = random.Random(f"reward:{args.seed}")
    reward_rows = [{"chat_template": row["prompt"], "chosen": row["sentence"],
                    "rejects": [f"{row['prefill']} {word}." for word in absent_words(row, 3, rng)]}
                   for row in prompts(f"reward{args.seed}", args.reward_rows, "train", training_length)]  # fmt: skip
    reward_model = train("simpo_disrm.yaml", demo.models["simpo_disrm"], write_jsonl(work / "reward.jsonl", reward_rows),
                         work / "runs" / "reward", ["--seed", str(args.seed), "--learning_rate", "1e-3"])  # fmt: skip
    lap("reward model")

    # 2. The policy, warmed up on right answers (the whole sentence: the prefill is the sentence's start).
    warm_rows = [{"prompt": row["prompt"], "completion": completion(row["sentence"])}
                 for row in prompts(f"warm{args.seed}", args.warm_rows, "train", training_length)]  # fmt: skip
    if args.policy_base == "judge":
        base = demo.models["judge"]
    else:
        base = policy_base(demo.models["judge"], args.policy_size, work / "models" / f"policy_{args.policy_size}",
                           args.seed)  # fmt: skip
    warm = sft(base, write_jsonl(work / "warm.jsonl", warm_rows), work / "runs" / "warm", args.warm_steps,
               args.warm_learning_rate, args.seed)  # fmt: skip
    lap("warm-up")

    # 3. Best-of-N: rollouts of the policy continuing each prefill, scored by the reward model (prefill + rollout).
    train_prompts = prompts(f"distill{args.seed}", args.prompts, "train", training_length)
    by_id = {row["id"]: row for row in train_prompts}
    write_jsonl(work / "prompts.jsonl", ({"id": row["id"], "prompt": prefilled(row)} for row in train_prompts))
    summary = distill(DistillConfig(
        input=str(work / "prompts.jsonl"), output=str(work / "distilled.jsonl"), num_rollouts=args.rollouts,
        policy={"name": "policy", "backend": "transformers", "model": str(warm)}, max_new_tokens=4, seed=args.seed,
        scorer={"model_path": str(reward_model), "backend": "transformers", "device": "cpu",
                "batch_size": 16}, batch_size=32))  # fmt: skip
    pick = random.Random(f"random:{args.seed}")
    arms = {"kept": [], "random": []}
    selection = {check: {"kept": [], "random": [], "best": []} for check in ("right", "stated")}
    for row in read_jsonl(work / "distilled.jsonl"):
        source = by_id[row["id"]]
        continuations = [text[len(source["prefill"]) :] for text in row["rollouts"]]
        for arm, index in (("kept", row["kept"]), ("random", pick.randrange(len(row["rollouts"])))):
            arms[arm].append({"prompt": row["messages"][:-1], "completion": completion(row["rollouts"][index])})
            for check, test in (("right", is_right), ("stated", is_stated)):
                selection[check][arm].append(test(source, continuations[index]))
        for check, test in (("right", is_right), ("stated", is_stated)):
            selection[check]["best"].append(any(test(source, text) for text in continuations))
    lap("distill")

    # 4. SFT on each arm; 5. every policy on the held-out prompts.
    heldout = prompts(f"heldout{args.seed}", args.heldout, "eval", lambda rng, i: (60, 120, 240)[i % 3])
    results = {"warm": score_policy(warm, heldout, args.samples, args.seed)}
    for arm, rows in arms.items():
        model = sft(warm, write_jsonl(work / f"{arm}.jsonl", rows), work / "runs" / arm, args.steps,
                    args.learning_rate, args.seed)  # fmt: skip
        results[arm] = score_policy(model, heldout, args.samples, args.seed)
    lap("arms")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "commit": commit, "seed": args.seed,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")},
        "rollouts": {check: {k: round(sum(v) / len(v), 4) for k, v in arms_.items()}
                     for check, arms_ in selection.items()},
        "distill_summary": {k: summary[k] for k in ("written", "dropped", "requests", "generated_tokens", "seconds")},
        "policies": results,
        "margin_points": {check: {key: round(100 * (results["kept"][check][key] - results["random"][check][key]), 1)
                                  for key in ("greedy", "sampled")} for check in ("right", "stated")},
        "timings_s": timings,
    }  # fmt: skip
    for check, shares in result["rollouts"].items():
        print(f"Rollouts {check}: kept {shares['kept']:.3f}, random {shares['random']:.3f}, any of the prompt's "
              f"{shares['best']:.3f}")  # fmt: skip
    print("| held-out answers % | right, greedy | right, sampled (T=1) | stated, greedy | stated, sampled (T=1) |")
    print("|---|---|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {100 * row['right']['greedy']:.1f} | {100 * row['right']['sampled']:.1f} | "
              f"{100 * row['stated']['greedy']:.1f} | {100 * row['stated']['sampled']:.1f} |")  # fmt: skip
    print(f"margin kept - random (points): {result['margin_points']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
