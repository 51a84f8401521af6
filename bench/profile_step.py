"""Profile one optimizer step of one benchmark configuration with `torch.profiler` and print where the time and the
memory go (the top operators by self CPU time and by self CPU memory). This is how the causes in
`bench/results/README.md` were found.

    python bench/profile_step.py --trainer disrm --impl ours --prompt-length 4096
    python bench/profile_step.py --trainer grm --impl stock --prompt-length 1024 --sort self_cpu_memory_usage
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


class ProfileSecondStep(common.StepTimer):
    """Profile the second optimizer step (the first allocates the optimizer state)."""

    def __init__(self, profiler):
        super().__init__()
        self.profiler = profiler

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.profiler.start()
        super().on_step_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if state.global_step == 2:
            self.profiler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=common.TRAINERS, required=True, help="grm or disrm.")
    parser.add_argument("--impl", choices=common.IMPLS, required=True, help="ours or stock.")
    parser.add_argument("--prompt-length", type=int, required=True, help="Tokens of the shared prompt.")
    parser.add_argument("--response-length", type=int, default=64, help="Longest response.")
    parser.add_argument("--sort", default="self_cpu_time_total", help="Column to sort the operator table by.")
    parser.add_argument("--rows", type=int, default=25, help="Rows of the operator table.")
    parser.add_argument("--trace", default=None, help="Also write a Chrome trace to this path.")
    cli = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from trl_longrm.testing_utils import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()
    groups = common.random_groups(2, cli.prompt_length, cli.response_length, tokenizer.eos_token_id)
    model = common.build_model("causal-lm" if cli.trainer == "grm" else "seq-cls", tokenizer)
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
    timer = ProfileSecondStep(profiler)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = common.build_trainer(cli.trainer, cli.impl, model, tokenizer, groups, output_dir, 2, [timer])
        trainer.train()
    print(f"step seconds: {timer.times}")
    print(profiler.key_averages().table(sort_by=cli.sort, row_limit=cli.rows))
    if cli.trace:
        profiler.export_chrome_trace(cli.trace)


if __name__ == "__main__":
    main()
