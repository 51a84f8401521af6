"""The sequence-tiled MLP (`mlp_tile_tokens`) on CPU: peak tensor memory and time of a training step, with and without,
side by side in one run. Our SimPO-GRM trainer, one process, TRL's gradient checkpointing, the benchmark model of
`common.py` with a Llama-like MLP ratio (intermediate 3.5x hidden), one group of a long prompt per step.

Peak memory is the live tensor bytes' peak inside the last step (`tensor_memory.TensorMemoryRecorder`, the CPU analogue
of `torch.cuda.max_memory_allocated`); time is the median step of a second, unprofiled run (each run in its own process).

    python bench/tiled_mlp.py --out bench/results/tiled_mlp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402


INTERMEDIATE_SIZE = 896  # 3.5 x hidden_size 256, as Llama-3-8B's 14336 / 4096


def run(prompt_length: int, settings: dict, steps: int, profile: bool) -> dict:
    """One run of `steps` steps of our GRM trainer with `settings` (config overrides) added."""
    from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model

    tokenizer = build_chat_tokenizer()
    groups = common.random_groups(steps, prompt_length, 256, tokenizer.eos_token_id)
    callbacks = []
    if profile:
        from tensor_memory import TensorMemoryRecorder

        recorder = TensorMemoryRecorder()
        recorder.start()
        callbacks.append(recorder)
    model = build_tiny_model(common.ARCH, "causal-lm", tokenizer, **{**common.MODEL_OVERRIDES,
                                                                      "intermediate_size": INTERMEDIATE_SIZE})  # fmt: skip
    timer = common.StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = common.build_trainer("grm", "ours", model, tokenizer, groups, output_dir, steps, [timer, *callbacks],
                                       **settings)  # fmt: skip
        trainer.train()
    result = {"step_seconds": timer.times}
    if profile:
        result["tensor_steps"] = [{k: s[k] for k in ("step", "start_bytes", "peak_bytes")} for s in recorder.finish(steps)]
    return result


def side_by_side(script: str, prompt_length: int, steps: int, runs: dict[str, dict]) -> tuple[dict, dict, dict]:
    """Each of `runs` (name -> settings) profiled and timed in its own processes (`script --worker`), in one call:
    the runs' records, their last step's peak tensor bytes and their median step after the first."""
    results = {}
    for name, settings in runs.items():
        for profile in (True, False):
            command = [sys.executable, script, "--prompt-length", str(prompt_length), "--steps", str(steps),
                       "--worker", json.dumps([settings, profile])]  # fmt: skip
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results.setdefault(name, {}).update(json.loads(output.rsplit("RESULT ", 1)[1]))
    peak = {k: r["tensor_steps"][-1]["peak_bytes"] for k, r in results.items()}
    step = {k: statistics.median(r["step_seconds"][1:]) for k, r in results.items()}
    return results, peak, step


def parse_or_work(doc: str, default_out: str, parser: argparse.ArgumentParser | None = None):
    """The command line of a side-by-side bench (`parser`'s own arguments too); in one of its runs' processes
    (`--worker`), that run, its JSON printed, and None."""
    parser = parser or argparse.ArgumentParser()
    parser.description, parser.formatter_class = doc, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--prompt-length", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one run, its JSON on stdout
    cli = parser.parse_args()
    if not cli.worker:
        return cli
    settings, profile = json.loads(cli.worker)
    print("RESULT " + json.dumps(run(cli.prompt_length, settings, cli.steps, profile)))
    return None


def report_header(cli) -> dict:
    """What a side-by-side report says of its command, software, machine, model and prompt."""
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": common.software_versions(),
        "machine": common.machine_description(),
        "model": {**common.MODEL_OVERRIDES, "intermediate_size": INTERMEDIATE_SIZE, "arch": common.ARCH},
        "prompt_length": cli.prompt_length,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tile-tokens", type=int, default=2048)
    cli = parse_or_work(__doc__, str(HERE / "results" / "tiled_mlp.json"), parser)
    if cli is None:
        return
    runs = {"None": {"mlp_tile_tokens": None}, str(cli.tile_tokens): {"mlp_tile_tokens": cli.tile_tokens}}
    results, peak, step = side_by_side(__file__, cli.prompt_length, cli.steps, runs)
    report = {
        **report_header(cli),
        "tile_tokens": cli.tile_tokens,
        "runs": results,
        "summary": {
            "peak_mib_untiled": round(peak["None"] / 2**20, 1),
            "peak_mib_tiled": round(peak[str(cli.tile_tokens)] / 2**20, 1),
            "peak_ratio_tiled_vs_untiled": round(peak[str(cli.tile_tokens)] / peak["None"], 3),
            "step_seconds_untiled": round(step["None"], 3),
            "step_seconds_tiled": round(step[str(cli.tile_tokens)], 3),
            "step_time_ratio_tiled_vs_untiled": round(step[str(cli.tile_tokens)] / step["None"], 3),
        },
    }
    Path(cli.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"]))


if __name__ == "__main__":
    main()
