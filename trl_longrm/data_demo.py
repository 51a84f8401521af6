"""The data demo (`make demo-data`): the method's data made by `trl-longrm data` from short synthetic records and a
distractor corpus, then the judge trained on it (SFT -> SimPO) and evaluated on the demo's held-out mini benchmark.

From nothing, in order:
1. the demo's synthetic suite (`trl_longrm.demo`): its DisRM data and its held-out benchmark (the judge data the demo
   writes by hand is not used here);
2. the data pipeline (`trl-longrm data OUTPUT/pipeline/pipeline.yaml`, written and run here): short records (a fact
   sheet's facts as the critical chunks, three of them asked) and a corpus of filler documents -> `expand` (long
   prompts at the benchmark's lengths, in tokens of the judge's tokenizer) -> `respond` (a scripted reader that answers
   from the context it is shown, perturbed by clue dropout, and a tiny model sampled through a served endpoint or
   transformers) -> `judge` (four scripted judges that err in their own ways: `trl_longrm.synthetic.scripted`) ->
   `vote` (SFT and SimPO rows);
3. the demo's DisRM, trained on the suite (the judge's stand-in for pretraining, as in `make demo`), its backbone the
   judge's base model, then SFT on the voted SFT rows and SimPO on the voted SimPO rows (`recipes/tiny/`), each
   evaluated on the held-out benchmark; a summary table (`summary.md`, `summary.json`).

`--chosen random` makes the ablation the method implies: each response's `chosen` judgment (and SFT target) is a
random one of its judges' judgments instead of the consensus (`bench/data_pipeline.py` compares both).

Every step resumes: the pipeline's steps record by record, the stages and evaluations as in `make demo`.

Example:
```bash
python -m trl_longrm.data_demo --output-dir demo_data_outputs
python -m trl_longrm.data_demo --output-dir demo_data_random --chosen random
```
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trl_longrm.demo import RECIPES, SMALL_DEMO, Demo, DemoConfig, demo_tokenizer, summary_table


logger = logging.getLogger(__name__)

DATA_PROMPTS = RECIPES / "data_prompts.yaml"
SCRIPTED = "trl_longrm.synthetic.scripted"
# The five judges, in their priority order: the careful one first. The lenient and the harsh one err in opposite
# directions (all values right / none right, half the time): with the lenient one alone, the rejected judgments of
# wrong responses were all over-counts and those of right ones mostly unscored, and SimPO learnt that a high count is
# wrong (stage II at 20.8% PairWise, from 77.4%); with a harsh judge that missed two values (1/3 for a right response),
# no row rejected a zero count and stage II drifted to zero counts (75.6%, from 86.3%).
JUDGES = {"exact": "exact_judge", "noisy": "noisy_judge", "lenient": "lenient_judge", "harsh": "harsh_judge",
          "sloppy": "sloppy_judge"}  # fmt: skip


@dataclass
class DataDemoConfig(DemoConfig):
    """Settings of `run_data_demo` (each field is a `--kebab-case` flag of `python -m trl_longrm.data_demo`); the
    fields of `DemoConfig` set the DisRM, the models, the stages and the evaluation as in `make demo`.

    Example:
    ```python
    >>> from trl_longrm.data_demo import DataDemoConfig, run_data_demo
    >>> summary = run_data_demo(DataDemoConfig(output_dir="/tmp/data_demo", num_records=400))
    ```
    """

    output_dir: str = field(
        default="demo_data_outputs",
        metadata={"help": "Where data, models, runs and results go. Default `demo_data_outputs`."},
    )
    num_records: int = field(
        default=1400, metadata={"help": "Short records the pipeline expands (one long prompt each). Default 1400."}
    )
    target_lengths: list[int] = field(
        default_factory=lambda: [40, 44, 50, 60, 70, 85, 100, 130, 170, 240],
        metadata={
            "help": "Context lengths in tokens, one drawn per record: about log-uniform from 40 (the facts and little "
            "else) to 240, as `make demo`'s training documents (the benchmark's: 60-240). Default 40-240."
        },
    )
    num_responses: int = field(
        default=2,
        metadata={"help": "The reader's responses per prompt: half with the clues, half without. Default 2."},
    )
    chosen: str = field(
        default="voted",
        metadata={
            "help": "The chosen judgment of each row: `voted` (the consensus) or `random` (one of the judges' at random: "
            "the ablation). Default voted.",
            "choices": ["voted", "random"],
        },
    )
    tiny_share: float = field(
        default=0.1,
        metadata={
            "help": "Share of the tiny model's voted rows the judge trains on (the rest are noise). Default 0.1."
        },
    )
    responder_url: str | None = field(
        default=None,
        metadata={
            "help": "`/v1` address of a served tiny model (vLLM) to sample a second responder from, with "
            "`responder_tokenizer`. Default None: the tiny model through transformers."
        },
    )
    responder_tokenizer: str | None = field(
        default=None, metadata={"help": "The served responder's tokenizer (a checkpoint folder)."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.chosen not in ("voted", "random"):
            raise ValueError(f"`chosen` must be 'voted' or 'random', got {self.chosen!r}.")
        if (self.responder_url is None) != (self.responder_tokenizer is None):
            raise ValueError("`responder_url` and `responder_tokenizer` go together.")


# The reduced data demo of the tests and the bench: the reduced demo's DisRM and stage II steps.
SMALL_DATA_DEMO = dict(SMALL_DEMO, num_records=1400)


@dataclass
class PipelineData:
    """The files the stages train and evaluate on: the pipeline's rows, the suite's DisRM set and benchmark."""

    sft: Path
    grm: Path
    disrm: Path
    benchmark: Path


class DataDemo(Demo):
    """The data demo: `Demo`'s DisRM, stages and evaluations, the judge's data made by the pipeline."""

    def pipeline_steps(self, root: Path) -> list[dict]:
        config = self.config
        responder = {"name": "tiny", "backend": "transformers", "model": str(root / "responder")}
        if config.responder_url:
            responder = {"name": "tiny", "backend": "openai", "base_url": config.responder_url,
                         "tokenizer": config.responder_tokenizer}  # fmt: skip
        common = {"prompts": str(DATA_PROMPTS)}
        reader = {"name": "reader", "backend": "python", "function": f"{SCRIPTED}:reader"}
        return [
            {"step": "expand", "input": str(root / "short.jsonl"), "corpus": str(root / "corpus.jsonl"),
             "tokenizer": str(root / "tokenizer"), "output": str(root / "long.jsonl"), "separator": " ",
             "target_lengths": list(config.target_lengths), "lengths_per_record": 1, "seed": config.seed},
            # The reader answers from the context it is shown; the tiny model (a random 2-layer model: noise) once.
            {"step": "respond", "output": str(root / "responses.jsonl"), "models": [reader, responder],
             "num_responses": {"reader": config.num_responses, "tiny": 1}, "max_new_tokens": 24, "temperature": 1.0,
             "perturbations": {"none": 0.5, "clue_dropout": 0.5}, "perturbation_mix": "proportional",
             "clue_dropout": 1.0, "seed": config.seed,
             "batch_size": 64, **common},
            {"step": "judge", "output": str(root / "judged.jsonl"),
             "judges": [{"name": name, "backend": "python", "function": f"{SCRIPTED}:{fn}"} for name, fn in JUDGES.items()],
             "max_new_tokens": 64, "seed": config.seed, "batch_size": 64, **common},
            {"step": "vote", "sft_output": str(root / "sft.jsonl"),
             "simpo_output": str(root / "simpo.jsonl"), "judge_priority": list(JUDGES), **common},
        ]  # fmt: skip

    def data(self) -> PipelineData:
        import yaml

        from trl_longrm.datagen.cli import main as data_main
        from trl_longrm.datagen.records import write_jsonl
        from trl_longrm.synthetic.scripted import filler_corpus, short_records
        from trl_longrm.testing_utils import save_tiny_model

        suite = super().data()
        root = self.root / "pipeline"
        root.mkdir(parents=True, exist_ok=True)
        if not (root / "short.jsonl").exists():
            write_jsonl(root / "corpus.jsonl", filler_corpus(self.config.seed, 4000))
            demo_tokenizer().save_pretrained(root / "tokenizer")
            if not self.config.responder_url:
                save_tiny_model(root / "responder", arch="qwen3", seed=self.config.seed, tokenizer=demo_tokenizer())
            write_jsonl(root / "short.jsonl", short_records(self.config.seed, self.config.num_records))
        path = root / "pipeline.yaml"
        path.write_text(yaml.safe_dump({"steps": self.pipeline_steps(root)}, sort_keys=False), encoding="utf-8")
        # `trl-longrm data OUTPUT/pipeline/pipeline.yaml`, as from a shell: every step resumes.
        if data_main([str(path)]) != 0:
            raise RuntimeError(
                f"The data pipeline {path} stopped (its message is above); run the demo again to resume."
            )
        sft, grm = self.training_rows(root)
        return PipelineData(sft=sft, grm=grm, disrm=suite.disrm, benchmark=suite.benchmark)

    def training_rows(self, root: Path) -> tuple[Path, Path]:
        """The voted rows as the stages read them: shortest context first (the tiny recipes read their data in order:
        `make demo`'s curriculum), a record's rows next to each other; with `chosen: random`, each row's chosen
        judgment one of its judges' at random."""
        from trl_longrm.datagen.records import write_jsonl

        def read(name):
            with open(root / name, encoding="utf-8") as handle:
                return [json.loads(line) for line in handle if line.strip()]

        sft, simpo = read("sft.jsonl"), read("simpo.jsonl")
        # The untrained tiny model's answers are noise that every judge scores 0: a few teach the judge to read a
        # response; as a third of the rows, the judge learnt to tell noise from fluent answers and not to read the
        # document (63.1% PairWise after SFT with them, 76.2% without, reduced demo, seed 0).
        rng = random.Random(f"tiny:{self.config.seed}")
        keep = {row["id"] for row in sft if row["response_model"] != "tiny" or rng.random() < self.config.tiny_share}
        sft = [row for row in sft if row["id"] in keep]
        simpo = [row for row in simpo if row["id"] in keep]
        if self.config.chosen == "random":
            judgments = _judgments_by_row(root / "judged.jsonl")
            rng = random.Random(self.config.seed)
            for row in sft:
                row["golden"] = rng.choice(judgments[row["id"]])
            for row in simpo:
                texts = list(dict.fromkeys(judgments[row["id"]]))
                row["chosen"] = rng.choice(texts)
                row["rejects"] = [text for text in texts if text != row["chosen"]] or row["rejects"]
        out = self.root / "data" / f"pipeline_{self.config.chosen}"
        paths = out / "sft.jsonl", out / "grm.jsonl"
        for rows, target in ((sft, paths[0]), (simpo, paths[1])):
            rows.sort(key=lambda row: row["target_tokens"])  # stable: a record's rows stay together
            write_jsonl(target, rows)
        return paths

    def settings(self) -> dict:
        settings = super().settings()
        # The pipeline's steps as written (paths under the output directory spelled `OUTPUT`).
        steps = json.dumps(self.pipeline_steps(Path("OUTPUT")))
        settings["pipeline"] = {"steps": json.loads(steps), "num_records": self.config.num_records,
                                "chosen": self.config.chosen, "tiny_share": self.config.tiny_share}  # fmt: skip
        settings["data_prompts"] = DATA_PROMPTS.read_text(encoding="utf-8")
        return settings


def _judgments_by_row(path: Path) -> dict[str, list[str]]:
    """Every judgment text of each voted row's response (row id `record/response`)."""
    found = {}
    with open(path, encoding="utf-8") as handle:
        for record in map(json.loads, filter(str.strip, handle)):
            for response, judgments in zip(record["responses"], record["judgments"], strict=True):
                found[f"{record['id']}/{response['id']}"] = [j["text"] for j in judgments]
    return found


def run_data_demo(config: DataDemoConfig | None = None) -> dict:
    """Run the data demo (see the module docstring); returns the summary written to `summary.json`."""
    return DataDemo(config or DataDemoConfig()).run()


def build_parser() -> argparse.ArgumentParser:
    from trl_longrm.dataclass_flags import flag_type
    from trl_longrm.demo import STAGES

    parser = argparse.ArgumentParser(prog="python -m trl_longrm.data_demo", description=__doc__.splitlines()[0])
    defaults = DataDemoConfig()
    for f in dataclasses.fields(DataDemoConfig):
        if f.name == "train_overrides":
            continue
        default = getattr(defaults, f.name)
        kwargs = {"dest": f.name, "help": f.metadata["help"], "default": default}
        if f.name == "target_lengths":
            kwargs.update(nargs="+", type=int)
        elif isinstance(default, list):
            kwargs.update(nargs="+", choices=list(STAGES) if f.name == "stages" else ["PairWise", "BestOfN"])
        elif isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = flag_type(DataDemoConfig, f, default)
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    summary = run_data_demo(DataDemoConfig(**vars(args)))
    print()
    print(summary_table(summary))
    print(f"Data demo finished in {time.perf_counter() - start:.0f} s; outputs in {args.output_dir}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
