"""GPU benchmark (needs one CUDA device): ours vs stock TRL on one GPU for a ~0.6B-parameter random-init model
(Qwen3-0.6B's shape, bf16, gradient checkpointing: TRL's defaults), writing one JSON report and `summary.json` beside it.

- Longest row: for each (trainer, implementation) the prompt length doubles from `--start-prompt-length` until a
  training run (two optimizer steps) raises CUDA out-of-memory, then `--bisect` halvings narrow the gap.
- Throughput: tokens/s and peak memory of each (trainer, implementation) at `--throughput-prompt-lengths`, k = 1;
  ours alone at k = `--shared-k` rejected responses with shared prefixes; model FLOPs utilisation (MFU) of ours.
- Each attempt runs in a fresh process (`--attempt`), so a failed allocation leaves nothing behind, and records the
  attention kernels ours resolved to and every warning (a fallback warning is a failure to fix).

Peak memory is `torch.cuda.max_memory_allocated()` minus the allocation after the model was built. Tokens are the real
tokens a group trains on in the unshared layout (`common.group_tokens`), the same count for ours and stock.

    python bench/gpu_longest_row.py --out bench/results/gpu/gpu.json
    python bench/gpu_longest_row.py --trainers grm --impls ours --start-prompt-length 16384 --out /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

from trl_longrm.memory_plan.shapes import SHAPES  # noqa: E402


# Qwen3-0.6B's shape (0.6B parameters with tied embeddings), random weights: nothing is downloaded.
QWEN3_0_6B = dict(
    vocab_size=common.VOCAB_SIZE,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=262144,
)


# The shapes a run can train (`--model`): Qwen3-0.6B's (every 0.6B figure), and the paper's 8B models from the
# config.json files the recipes' dry runs plan (the package's bundled shapes). Random weights, built on the GPU.
CONFIGS = SHAPES
MODELS = {"qwen3-0.6b": None, "qwen3-8b": CONFIGS / "qwen3-8b.json", "llama-3.1-8b": CONFIGS / "llama-3.1-8b.json"}
# Keys of a config.json that are not the shape (the fixture tokenizer's special tokens replace the token ids).
_NOT_SHAPE = ("architectures", "model_type", "torch_dtype", "bos_token_id", "eos_token_id", "use_cache")


def model_shape(name: str) -> tuple[str, dict]:
    """`(architecture, config overrides)` of `--model` `name`, for `build_tiny_model` / `tiny_config`."""
    if MODELS[name] is None:
        return common.ARCH, dict(QWEN3_0_6B)
    config = json.loads(MODELS[name].read_text())
    shape = {k: v for k, v in config.items() if k not in _NOT_SHAPE}
    shape.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return config["model_type"], shape


def lora_config(trainer: str, r: int):
    """The LoRA adapter of the recipes (`*_lora.yaml`: all linear layers, alpha = 2r for the GRM as there, alpha = r
    and PEFT's SEQ_CLS task, which trains the new score head, for the DisRM), or None for `r` = 0."""
    if not r:
        return None
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r if trainer == "grm" else r, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM" if trainer == "grm" else "SEQ_CLS")


# The long-row settings of the `*_1m.yaml` recipes (docs/memory.md), ours only: checkpointed layer inputs offloaded to
# host memory, the MLP (and final norm) over slices of 16,384 tokens.
LONG_ROWS = dict(gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True}, mlp_tile_tokens=16384)


# Settings a user turns on for speed (`--variants`), each run beside the default in the same call: selective
# checkpointing (the attention kernels' outputs kept, not recomputed: docs/memory.md) and Liger's layer kernels (fused
# RMSNorm, RoPE, SwiGLU; TRL's `use_liger_kernel`, needs liger-kernel: carried by gpu_check.sh). What bounds the MFU at
# 32K (docs/gpu.md): the attention's recompute, and elementwise kernels these fuse.
# Issue 64's levers: partial checkpointing (the first N layers unchecked, N the memory plan's proposal for the run:
# `gpu_plan_vs_measured.py --propose-unchecked`, passed as `--unchecked-layers VARIANT=N`), the fused LoRA path, and
# all of them together with selective checkpointing and Liger's kernels ("best").
UNCHECKED = None  # stands for the run's `--unchecked-layers`
VARIANTS = {
    "default": {},
    "selective": dict(gradient_checkpointing_kwargs={"selective": True}),
    "liger": dict(use_liger_kernel=True),
    "selective_liger": dict(gradient_checkpointing_kwargs={"selective": True}, use_liger_kernel=True),
    "partial": dict(gradient_checkpointing_kwargs={"unchecked_layers": UNCHECKED}),
    "fused_lora": dict(fused_lora=True),
    "best": dict(gradient_checkpointing_kwargs={"selective": True, "unchecked_layers": UNCHECKED},
                 use_liger_kernel=True, fused_lora=True),
    # 'best' for full-parameter runs (no LoRA to fuse).
    "best_full": dict(gradient_checkpointing_kwargs={"selective": True, "unchecked_layers": UNCHECKED},
                      use_liger_kernel=True),
}


def run_settings(long_rows: bool = False, variant: str = "default", unchecked_layers: int | None = None) -> dict:
    """The training arguments a run adds to `common.build_trainer`'s: the long-row settings (`long_rows`) and the
    variant's, their `gradient_checkpointing_kwargs` merged (a selective variant at long rows offloads and keeps the
    attention outputs both), a variant's unchecked layers being `unchecked_layers`."""
    settings = {**(LONG_ROWS if long_rows else {}), **VARIANTS[variant]}
    key = "gradient_checkpointing_kwargs"
    kwargs = {**((LONG_ROWS if long_rows else {}).get(key) or {}), **(VARIANTS[variant].get(key) or {})}
    if "unchecked_layers" in kwargs:
        if unchecked_layers is None:
            raise SystemExit(f"variant {variant!r} leaves layers unchecked: give --unchecked-layers {variant}=N "
                             "(the memory plan's proposal: gpu_plan_vs_measured.py --propose-unchecked).")
        kwargs["unchecked_layers"] = unchecked_layers
    if kwargs:
        settings[key] = kwargs
    return settings


# bf16 dense peak of the GPUs this runs on (tensor cores, no sparsity), for the MFU.
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def peak_flops(device_name: str) -> float | None:
    return next((value for key, value in PEAK_BF16_FLOPS.items() if key in device_name), None)


def model_flops(groups: list[dict], shared: bool, trainer: str, shape: dict = QWEN3_0_6B, lora_r: int = 0) -> float:
    """Model FLOPs of a training step over `groups` (forward + backward = 3x forward, the recompute of gradient
    checkpointing not counted, as MFU is defined): 6 x (non-embedding matmul parameters) per token processed, plus
    12 x heads x head_dim per attended (query, key) pair per layer. The LM head counts only for stock GRM (ours
    computes the label log-probs without the full logits) and not at all for DisRM (a one-column score).

    With LoRA (`lora_r` > 0, all linear layers) the frozen weights get no gradient: 4 x their parameters per token
    (forward, and the backward to the inputs only), and the adapters their full 6 x r x (in + out) per token."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    q_dim = shape["num_attention_heads"] * shape["head_dim"]
    kv_dim = shape["num_key_value_heads"] * shape["head_dim"]
    inter = shape["intermediate_size"]
    per_layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * inter
    # in + out features of each linear layer of a decoder layer (q, k, v, o, gate, up, down)
    adapter = lora_r * (3 * hidden + q_dim + 2 * kv_dim + q_dim + hidden + 3 * (hidden + inter))
    matmul_per_token = (4 * per_layer + 6 * adapter) if lora_r else 6 * per_layer
    tokens, pairs = 0, 0
    for group in groups:
        prompt = len(group["prompt_ids"])
        responses = [len(r) for r in [group["chosen_completion_ids"], *group["rejected_completion_ids"]]]
        if shared:
            tokens += prompt + sum(responses)
            pairs += prompt * (prompt + 1) // 2 + sum(r * prompt + r * (r + 1) // 2 for r in responses)
        else:
            tokens += sum(prompt + r for r in responses)
            pairs += sum((prompt + r) * (prompt + r + 1) // 2 for r in responses)
    flops = matmul_per_token * layers * tokens + 12 * q_dim * pairs * layers
    if trainer == "grm" and not shared:
        flops += 6 * hidden * shape["vocab_size"] * tokens
    return float(flops)


def flops_6n_convention(group: dict, shared: bool, arch: str, shape: dict, tokenizer) -> float:
    """FLOPs of a step over `group` in the convention of TRL's `compute_flops_per_token` (the one torchtitan and
    nanoGPT report): 6 x every matmul parameter per token, the LM head included, frozen weights counted as trained
    ones, attention not halved for causality (each token against the whole row), over the tokens a step computes
    (`processed_tokens`), each row's length its sequence length. More than `model_flops` counts (our strict
    convention, which MFU figures here quote): the two side by side compare with others' reports."""
    from trl.trainer.utils import compute_flops_per_token

    from trl_longrm.testing_utils import tiny_config

    config = tiny_config(arch, tokenizer, **shape)
    responses = [len(r) for r in [group["chosen_completion_ids"], *group["rejected_completion_ids"]]]
    prompt = len(group["prompt_ids"])
    rows = [prompt + sum(responses)] if shared else [prompt + r for r in responses]
    return float(sum(compute_flops_per_token(config, row) * row for row in rows))


def processed_tokens(group: dict, shared: bool) -> int:
    """Tokens a step computes for `group`: its prompt once and every response with shared prefixes, else one row of
    prompt + response per response (`common.group_tokens`)."""
    if not shared:
        return common.group_tokens(group)
    return len(group["prompt_ids"]) + sum(map(len, [group["chosen_completion_ids"], *group["rejected_completion_ids"]]))


def attempt(trainer: str, impl: str, prompt_length: int, steps: int, response_length: int,
            num_rejected: int = 1, profile: bool = False, shape: dict = QWEN3_0_6B, long_rows: bool = False,
            memory_cap_gib: float | None = None, variant: str = "default", arch: str = common.ARCH,
            model_name: str = "qwen3-0.6b", lora_r: int = 0, memory_sites: bool = False,
            unchecked_layers: int | None = None) -> dict:
    """One training run in this process; returns its record (status 'oom' on CUDA out-of-memory). With `profile`, the
    last step runs under `torch.profiler` and the record's `profile` says where its time went (`step_profile.py`).
    Without CUDA (a rehearsal) it runs on CPU, without memory or FLOPs figures. `memory_cap_gib`: the caching
    allocator may hold no more than this (`torch.cuda.set_per_process_memory_fraction`), a smaller GPU emulated.
    `variant`: one of `VARIANTS`, the settings it adds. `arch`/`shape`: the model (`model_shape`), named `model_name`
    in the record; `lora_r` > 0: trained through a LoRA adapter of that rank (`lora_config`), as the recipes do.
    With `profile` and 3+ steps the profiled (last) step is left out of the timing. `memory_sites`: the record's
    `memory_sites` says which code allocated the tensors live at the peak (`cuda_memory_sites.py`; it slows the run:
    no timings then)."""
    import warnings

    import torch

    from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model

    sys.path.insert(0, str(HERE))
    from gpu_defaults import record_kernels

    kernels = record_kernels()
    tokenizer = build_chat_tokenizer()
    groups = common.random_groups(steps, prompt_length, response_length, tokenizer.eos_token_id,
                                  warmup_prompt_length=None, num_rejected=num_rejected, vocab_size=shape["vocab_size"])
    task = "causal-lm" if trainer == "grm" else "seq-cls"
    cuda = torch.cuda.is_available()
    if cuda and memory_cap_gib is not None:
        torch.cuda.set_per_process_memory_fraction(memory_cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    with torch.device("cuda" if cuda else "cpu"):  # initialised on the GPU: seconds instead of a minute of CPU init
        model = build_tiny_model(arch, task, tokenizer, seed=0, dtype=torch.bfloat16, **shape)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    timer = CudaStepTimer()
    callbacks = [timer]
    if memory_sites:
        from cuda_memory_sites import MemorySites

        sites = MemorySites()
        sites.start()
    if profile:
        from step_profile import ProfileLastStep

        callbacks.append(ProfileLastStep(steps))
    record = {"trainer": trainer, "impl": impl, "prompt_length": prompt_length, "num_rejected": num_rejected,
              "steps": steps, **({"long_rows": True} if long_rows else {}),
              **({"model": model_name} if model_name != "qwen3-0.6b" else {}),
              **({"lora_r": lora_r} if lora_r else {}),
              **({"num_hidden_layers": shape["num_hidden_layers"]}
                 if shape["num_hidden_layers"] != model_shape(model_name)[1]["num_hidden_layers"] else {}),
              **({"variant": variant} if variant != "default" else {}),
              **({"unchecked_layers": unchecked_layers} if unchecked_layers is not None else {}),
              **({"memory_cap_gib": memory_cap_gib} if memory_cap_gib is not None else {})}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with tempfile.TemporaryDirectory() as output_dir:
                instance = common.build_trainer(trainer, impl, model, tokenizer, groups, output_dir, steps, callbacks,
                                                peft_config=lora_config(trainer, lora_r), use_cpu=not cuda, bf16=cuda,
                                                **run_settings(long_rows, variant, unchecked_layers))
                shared = bool(getattr(instance.args, "shared_prefix", False) and instance.args.padding_free)
                instance.train()
                if VARIANTS[variant].get("use_liger_kernel"):  # the modules whose forward Liger replaced
                    from trl_longrm.memory.tiled_mlp import untiled_forward  # (with long rows, Liger's tiled again)

                    record["liger_modules"] = sum(getattr(untiled_forward(m), "__qualname__", "").startswith("Liger")
                                                  for m in instance.model.modules())  # fmt: skip
        except torch.OutOfMemoryError:
            record.update(status="oom", peak_mem_bytes=torch.cuda.max_memory_allocated() - base,
                          kernels=sorted(kernels))
            return record
    if memory_sites:
        record["memory_sites"] = sites.finish()
    tokens = [common.group_tokens(g) for g in groups]
    flops = [model_flops([g], shared, trainer, shape, lora_r) for g in groups]
    flops_6n = [flops_6n_convention(g, shared, arch, shape, tokenizer) for g in groups]
    # The first step is not timed (allocations, kernel selection); nor is a profiled last step (the profiler's cost).
    last = steps - 1 if profile and steps >= 3 else steps
    timed = timer.times[1:last]
    device_peak = peak_flops(torch.cuda.get_device_name(0)) if cuda else None
    record.update(
        status="ok",
        shared_prefix=shared,
        tokens_per_step=tokens,
        step_seconds=timer.times,
        timed_steps=[2, last] if timed else None,
        tokens_per_s=sum(tokens[1:last]) / sum(timed) if timed else None,
        model_flops_per_step=flops,
        mfu=sum(flops[1:last]) / sum(timed) / device_peak if timed and device_peak else None,
        # The same steps in TRL's and torchtitan's convention (`flops_6n_convention`), for comparison with theirs.
        mfu_6n=sum(flops_6n[1:last]) / sum(timed) / device_peak if timed and device_peak else None,
        trainable_params=sum(p.numel() for p in instance.model.parameters() if p.requires_grad),
        # The tokens the step computes (with shared prefixes the prompt once per group), per second.
        processed_tokens_per_s=sum(processed_tokens(g, shared) for g in groups[1:last]) / sum(timed) if timed else None,
        peak_mem_bytes=torch.cuda.max_memory_allocated() - base if cuda else None,
        # The whole picture of the card for the plan's absolute figures: the weights' allocation, the caching
        # allocator's reserved peak, and what the driver says the card holds and has free at the end.
        **({"base_mem_bytes": base, "reserved_peak_bytes": torch.cuda.max_memory_reserved(),
            "device_free_total_bytes": list(torch.cuda.mem_get_info())} if cuda else {}),
        num_params=sum(p.numel() for p in model.parameters()),
        kernels=sorted(kernels),
        warnings=sorted({f"{w.category.__name__}: {w.message}"[:300] for w in caught
                         if not issubclass(w.category, (DeprecationWarning, FutureWarning))}),
    )
    if profile:
        record["profile"] = callbacks[-1].result
        if record["profile"] and record["model_flops_per_step"]:
            # Model FLOPs of the profiled step over its kernels' time: the MFU the kernels would reach with the
            # device never idle (what the host costs is the rest).
            busy = record["profile"]["kernel_seconds"]
            record["profile"]["mfu_if_never_idle"] = (
                record["model_flops_per_step"][-1] / busy / device_peak if busy and device_peak else None
            )
    return record


class CudaStepTimer(common.StepTimer):
    """Step times with the GPU work of the step finished (CUDA runs asynchronously)."""

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        super().on_step_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        super().on_step_end(args, state, control, **kwargs)


def run_attempt(trainer: str, impl: str, prompt_length: int, steps: int, cli, num_rejected: int = 1,
                profile: bool = False, long_rows: bool = False, variant: str = "default") -> dict:
    model = {**({"model": cli.model} if cli.model != "qwen3-0.6b" else {}),
             **({"lora_r": cli.lora_r} if cli.lora_r else {})}  # fmt: skip
    command = [sys.executable, __file__, "--attempt", f"--trainers={trainer}", f"--impls={impl}",
               f"--model={cli.model}", f"--lora-r={cli.lora_r}", *(["--memory-sites"] if cli.memory_sites else []),
               f"--start-prompt-length={prompt_length}", f"--steps={steps}",
               f"--response-length={cli.response_length}", f"--shared-k={num_rejected}", "--out=-",
               *(["--profile"] if profile else []), *(["--long-rows"] if long_rows else []),
               *([f"--variants={variant}"] if variant != "default" else []),
               *([f"--unchecked-layers={variant}={cli.unchecked_layers[variant]}"]
                 if variant in cli.unchecked_layers else []),
               *([f"--num-hidden-layers={cli.num_hidden_layers}"] if cli.num_hidden_layers else []),
               *([f"--memory-cap-gib={cli.memory_cap_gib}"] if cli.memory_cap_gib is not None else [])]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=cli.timeout)
    except subprocess.TimeoutExpired:
        return {"trainer": trainer, "impl": impl, "prompt_length": prompt_length, "num_rejected": num_rejected,
                "status": "timeout", **model, **({"long_rows": True} if long_rows else {}),
                **({"variant": variant} if variant != "default" else {})}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"trainer": trainer, "impl": impl, "prompt_length": prompt_length, "num_rejected": num_rejected,
                "status": "error", **model, **({"long_rows": True} if long_rows else {}),
                **({"variant": variant} if variant != "default" else {}),
                "error_tail": done.stderr.strip().splitlines()[-5:]}
    record = json.loads(lines[-1][len("RESULT ") :])
    record["wall_seconds"] = round(time.monotonic() - started, 1)
    print(f"{cli.model} {trainer:5s} {impl:5s} k={num_rejected} prompt {prompt_length:7d}"
          f"{' LoRA r=' + str(cli.lora_r) if cli.lora_r else ''}{' long rows' if long_rows else ''}"
          f"{' ' + variant if variant != 'default' else ''}: "
          f"{record['status']}"
          + (f", peak {record['peak_mem_bytes'] / 2**30:.1f} GiB" if record.get("peak_mem_bytes") is not None else "")
          + (f", {record['tokens_per_s']:.0f} tokens/s" if record.get("tokens_per_s") else "")
          + (f", MFU {record['mfu']:.3f}" if record.get("mfu") else "")
          + (f", kernels {record['kernels']}" if record.get("kernels") else "")
          + (f", warnings {record['warnings']}" if record.get("warnings") else "")
          + (f", error {record['error_tail']}" if record.get("error_tail") else ""), flush=True)
    return record


def longest_row(trainer: str, impl: str, cli, known: list[dict] = ()) -> dict:
    """Doubling search, then `cli.bisect` bisection steps between the last success and the first failure. A length
    already tried by a throughput run (`known`, k = 1) is not run again."""
    attempts, good, bad = [], None, None
    length = cli.start_prompt_length
    tried = {r["prompt_length"]: r for r in known
             if (r["trainer"], r["impl"], r.get("num_rejected", 1)) == (trainer, impl, 1) and r["status"] in ("ok", "oom")}
    while length <= cli.max_prompt_length:
        record = tried.get(length) or run_attempt(trainer, impl, length, 2, cli)
        attempts.append(record)
        if record["status"] != "ok":
            bad = length
            break
        good, length = length, length * 2
    for _ in range(cli.bisect if good and bad else 0):
        middle = (good + bad) // 2
        record = run_attempt(trainer, impl, middle, 2, cli)
        attempts.append(record)
        good, bad = (middle, bad) if record["status"] == "ok" else (good, middle)
    best = next((a for a in attempts if a["status"] == "ok" and a["prompt_length"] == good), None)
    return {
        "trainer": trainer,
        "impl": impl,
        "longest_prompt_length": good,
        "longest_row_tokens": max(best["tokens_per_step"]) if best else None,
        "first_failing_prompt_length": bad,
        "attempts": attempts,
    }


def summary_8b(report: dict) -> dict:
    """The 8B runs' figures (issue 55): per run (`<model>_<trainer>_<prompt>k`) tokens/s, MFU against the dense bf16
    peak and against the GEMM rate measured on the same machine (`--gemm-report`), peak memory, and the profile;
    then `mfu_32k_8b` (the best 8B run at a 32K prompt), `tokens_per_s_8b_32k` and `peak_gib_8b_131k` (per run)."""
    out = {}
    gemm = (report.get("gemm") or {}).get("tflops")
    for r in report["throughput"]:
        if "model" not in r:
            continue
        name = (f"{r['model']}_{r['trainer']}_{r['prompt_length'] // 1024}k" + ("_long_rows" if r.get("long_rows") else "")
                + (f"_{r['variant']}" if r.get("variant", "default") != "default" else "")
                + (f"_{r['num_hidden_layers']}layers" if r.get("num_hidden_layers") else ""))
        if r["status"] != "ok":
            out[f"status_8b_{name}"] = r["status"]
            continue
        run = {"num_rejected": r.get("num_rejected", 1), "lora_r": r.get("lora_r", 0),
               "long_rows": bool(r.get("long_rows")), "tokens_per_s": r.get("tokens_per_s"),
               "processed_tokens_per_s": r.get("processed_tokens_per_s"), "mfu": r.get("mfu"),
               **({"mfu_6n": r["mfu_6n"]} if r.get("mfu_6n") else {}),
               **({"unchecked_layers": r["unchecked_layers"]} if r.get("unchecked_layers") is not None else {}),
               "peak_gib": r["peak_mem_bytes"] / 2**30 if r.get("peak_mem_bytes") is not None else None,
               "step_seconds": r.get("step_seconds"), "kernels": r.get("kernels")}  # fmt: skip
        if gemm and r.get("timed_steps") and r.get("model_flops_per_step"):
            first, last = r["timed_steps"]
            flops = sum(r["model_flops_per_step"][first - 1 : last])
            run["mfu_vs_measured_gemm"] = flops / sum(r["step_seconds"][first - 1 : last]) / (gemm * 1e12)
        if r.get("profile"):
            run["profile"] = {key: r["profile"].get(key) for key in ("kernel_share", "device_busy_fraction",
                                                                      "mfu_if_never_idle", "step_wall_seconds")}
        out[f"run_8b_{name}"] = run
        if r["prompt_length"] == 32768:
            out.setdefault("tokens_per_s_8b_32k", {})[name] = run["tokens_per_s"]
            out.setdefault("processed_tokens_per_s_8b_32k", {})[name] = run["processed_tokens_per_s"]
            out.setdefault("mfu_8b_32k", {})[name] = run["mfu"]
            if run.get("mfu_6n"):
                out.setdefault("mfu_6n_8b_32k", {})[name] = run["mfu_6n"]
            if run["mfu"] and run["mfu"] > out.get("mfu_32k_8b", 0):
                out["mfu_32k_8b"], out["mfu_32k_8b_run"] = run["mfu"], name
                if run.get("mfu_6n"):
                    out["mfu_6n_32k_8b"] = run["mfu_6n"]
        if r["prompt_length"] == 131072:
            out.setdefault("peak_gib_8b_131k", {})[name] = run["peak_gib"]
    if gemm:
        out["gemm_tflops_measured"] = gemm
    if out:
        out["conventions"] = (
            "mfu: ours, strict (LoRA's frozen weights 4 FLOPs per parameter per token, attention causal, a shared "
            "prompt once, recomputation not counted; `model_flops`); mfu_6n: TRL's compute_flops_per_token, as "
            "torchtitan reports (6 x every matmul parameter, attention not halved; `flops_6n_convention`). "
            "tokens_per_s: the unshared layout's tokens (the prompt once per response); processed_tokens_per_s: the "
            "tokens a step computes (the prompt once)."
        )
    return out


def summary(report: dict) -> dict:
    """The ratios issue 33 asks for (ours / stock) from a report."""
    out = {"device": report["gpu"], "versions": report["versions"]}
    out.update(summary_8b(report))
    report = {**report, "throughput": [r for r in report["throughput"] if "model" not in r]}
    longest = {(r["trainer"], r["impl"]): r for r in report["longest_row"]}
    for trainer in common.TRAINERS:
        ours, stock = longest.get((trainer, "ours")), longest.get((trainer, "stock"))
        if ours and stock and ours["longest_prompt_length"] and stock["longest_prompt_length"]:
            out[f"longest_row_ratio_{trainer}"] = ours["longest_prompt_length"] / stock["longest_prompt_length"]
            # Ours may still train past the search's cap: then the ratio is a lower bound.
            out[f"longest_row_ratio_{trainer}_is_lower_bound"] = ours["first_failing_prompt_length"] is None
        ok = {(r["impl"], r["prompt_length"]): r for r in report["throughput"]
              if r["trainer"] == trainer and r.get("num_rejected", 1) == 1 and r["status"] == "ok"
              and r.get("variant", "default") == "default"}
        both = sorted(length for impl, length in ok if impl == "ours" and ("stock", length) in ok)
        if both:
            length = both[-1]
            out[f"tokens_per_s_ratio_{trainer}"] = ok[("ours", length)]["tokens_per_s"] / ok[("stock", length)][
                "tokens_per_s"]
            out[f"tokens_per_s_ratio_{trainer}_prompt_length"] = length
        at_32k = ok.get(("ours", 32768))
        if at_32k and at_32k.get("mfu"):
            out[f"mfu_32k_{trainer}"] = at_32k["mfu"]
        for variant in VARIANTS:
            # Each variant beside the default of the same report (side by side in one call): its MFU, its tokens/s
            # and peak over the default's, or how it ended.
            run = next((r for r in report["throughput"] if r["trainer"] == trainer and r["impl"] == "ours"
                        and r["prompt_length"] == 32768 and r.get("num_rejected", 1) == 1
                        and r.get("variant") == variant != "default"), None)  # fmt: skip
            if run is None:
                continue
            if run["status"] != "ok":
                out[f"variant_status_32k_{trainer}_{variant}"] = run["status"]
                continue
            out[f"mfu_32k_{trainer}_{variant}"] = run.get("mfu")
            if at_32k and at_32k.get("tokens_per_s") and run.get("tokens_per_s"):
                out[f"tokens_per_s_ratio_32k_{trainer}_{variant}_vs_default"] = run["tokens_per_s"] / at_32k["tokens_per_s"]
            if at_32k and at_32k.get("peak_mem_bytes") and run.get("peak_mem_bytes"):
                out[f"peak_ratio_32k_{trainer}_{variant}_vs_default"] = run["peak_mem_bytes"] / at_32k["peak_mem_bytes"]
    if "mfu_32k_grm" in out:
        out["mfu_32k"] = out["mfu_32k_grm"]
    pairs = {}
    for r in report.get("long_rows", []):
        pairs.setdefault(r["prompt_length"], {})[bool(r.get("long_rows"))] = r
    for length, pair in sorted(pairs.items()):
        if len(pair) < 2:
            continue
        if all(r["status"] == "ok" for r in pair.values()):
            # The long-row settings' memory saving and their step cost (median step after the first), ours GRM.
            out[f"long_rows_peak_ratio_{length}"] = pair[True]["peak_mem_bytes"] / pair[False]["peak_mem_bytes"]
            if all(len(r["step_seconds"]) > 1 for r in pair.values()):
                steps = {k: sorted(v["step_seconds"][1:])[len(v["step_seconds"][1:]) // 2] for k, v in pair.items()}
                out[f"long_rows_step_ratio_{length}"] = steps[True] / steps[False]
        else:
            # A length past what trains without the long-row settings: how each attempt ended.
            out[f"long_rows_status_{length}"] = {("with" if k else "without"): r["status"] for k, r in pair.items()}
            if pair[True]["status"] == "ok":
                out[f"long_rows_peak_gib_{length}"] = round(pair[True]["peak_mem_bytes"] / 2**30, 2)
    for long_rows, name in ((False, "without"), (True, "with")):
        # Bracket of the longest row that trains with / without the long-row settings (under the report's cap, if
        # any): the longest attempt that trained, and the shortest that ran out of memory.
        ended = [r for r in report.get("long_rows", []) if bool(r.get("long_rows")) == long_rows]
        trained = [r["prompt_length"] for r in ended if r["status"] == "ok"]
        failed = [r["prompt_length"] for r in ended if r["status"] == "oom"]
        if trained:
            out[f"long_rows_longest_ok_{name}"] = max(trained)
        if failed:
            out[f"long_rows_first_oom_{name}"] = min(failed)
    if report.get("memory_cap_gib") is not None:
        out["memory_cap_gib"] = report["memory_cap_gib"]
    profiled = (report.get("profile") or {}).get("profile")
    if profiled:
        # What bounds the MFU: the kernels' shares of the device time, and how much of the step the device idled.
        out["profile"] = {"prompt_length": report["profile"]["prompt_length"],
                          **{key: profiled.get(key) for key in ("kernel_share", "device_busy_fraction",
                                                                "mfu_if_never_idle", "step_wall_seconds")}}
    for variant, run in sorted((report.get("variant_profiles") or {}).items()):
        if run.get("profile"):
            out[f"profile_{variant}"] = {key: run["profile"].get(key) for key in ("kernel_share", "device_busy_fraction",
                                                                                   "mfu_if_never_idle", "step_wall_seconds")}
    return out


def run_key(record: dict) -> tuple:
    """What tells one throughput run from another in a report (a run already there is not run again)."""
    return (record["trainer"], record["impl"], record["prompt_length"], record.get("num_rejected", 1),
            record.get("variant", "default"), record.get("model", "qwen3-0.6b"), record.get("lora_r", 0),
            bool(record.get("long_rows")), record.get("num_hidden_layers"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", choices=common.TRAINERS, default=list(common.TRAINERS))
    parser.add_argument("--impls", nargs="+", choices=common.IMPLS, default=list(common.IMPLS))
    parser.add_argument("--start-prompt-length", type=int, default=8192, help="First prompt length tried.")
    parser.add_argument("--max-prompt-length", type=int, default=131072, help="Stop doubling past this.")
    parser.add_argument("--bisect", type=int, default=1, help="Bisection steps after the doubling search.")
    parser.add_argument("--throughput-prompt-lengths", type=int, nargs="*", default=[8192, 32768, 65536],
                        help="Prompt lengths of the tokens/s comparison (none to skip).")
    parser.add_argument("--shared-k", type=int, default=4,
                        help="Rejected responses of ours' shared-prefix throughput runs (with --attempt: of this run).")
    parser.add_argument("--skip-longest", action="store_true", help="Throughput runs only.")
    parser.add_argument("--ours-at-stock-multiple", type=float, default=None,
                        help="Longest rows: stock searched first, then ours tried once at this multiple of stock's "
                             "longest prompt (a lower bound of the ratio, in the time a long search would not fit).")
    parser.add_argument("--steps", type=int, default=3, help="Steps of the tokens/s runs (the first is not timed).")
    parser.add_argument("--response-length", type=int, default=256, help="Longest response (tokens).")
    parser.add_argument("--timeout", type=float, default=1800.0, help="Seconds before an attempt is given up.")
    parser.add_argument("--resume", action="store_true",
                        help="Read the report at --out and run only the attempts it does not hold yet.")
    parser.add_argument("--profile-prompt-length", type=int, default=None,
                        help="Also profile one step of ours (GRM, k = 1) at this prompt length: where the time goes.")
    parser.add_argument("--profile", action="store_true",
                        help="Profile the last step of each throughput run (left out of its timing from 3 steps on); "
                             "with --attempt, of that run.")
    parser.add_argument("--long-rows-prompt-lengths", type=int, nargs="*", default=[],
                        help="Ours (GRM, k = 1) at these prompt lengths with the long-row settings (checkpoint offload "
                             "and the tiled MLP) next to without: their memory saving and step cost.")
    parser.add_argument("--long-rows-settings", choices=("both", "without", "with"), default="both",
                        help="Which of the pair --long-rows-prompt-lengths runs at each length.")
    parser.add_argument("--long-rows", action="store_true",
                        help="The long-row settings on every throughput run of ours (with --attempt: on that run).")
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-0.6b",
                        help="The model's shape (random weights): Qwen3-0.6B's, or a bundled 8B one.")
    parser.add_argument("--lora-r", type=int, default=0,
                        help="Train through a LoRA adapter of this rank on all linear layers (0: full parameters).")
    parser.add_argument("--memory-sites", action="store_true",
                        help="Record which code allocated the tensors live at each run's peak (CUDA allocator history).")
    parser.add_argument("--skip-k1", action="store_true",
                        help="Throughput runs of ours at --shared-k only (no k = 1 run).")
    parser.add_argument("--gemm-report", default=None,
                        help="A `gpu_attention_kernels.py` report of the same machine: its bf16 GEMM TFLOP/s is the "
                             "measured peak a second MFU is taken against (`mfu_vs_measured_gemm`).")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["default"],
                        help="Settings of the throughput runs of ours, each a run of its own ('default' first: the "
                             "others are compared with it); with --attempt, the one variant.")
    parser.add_argument("--unchecked-layers", nargs="*", default=[], metavar="VARIANT=N",
                        help="Decoder layers left unchecked by the variants that leave some ('partial', 'best'): the "
                             "memory plan's proposal for the run (gpu_plan_vs_measured.py --propose-unchecked).")
    parser.add_argument("--unchecked-fallback", type=int, default=0,
                        help="A run with --unchecked-layers that runs out of memory is run once more with this many "
                             "layers fewer unchecked (0: not).")
    parser.add_argument("--profile-variants", nargs="*", choices=list(VARIANTS), default=[],
                        help="Also profile ours at --profile-prompt-length with each of these variants.")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="Cap the caching allocator of every attempt at this many GiB: a smaller GPU emulated "
                             "(a report holds runs of one cap only; `gpu_plan_vs_measured.py` plans for it).")
    parser.add_argument("--num-hidden-layers", type=int, default=None,
                        help="Fewer layers than Qwen3-0.6B's 28 (a CPU rehearsal of --attempt).")
    parser.add_argument("--attempt", action="store_true", help="Internal: run one attempt and print its record.")
    parser.add_argument("--rehearse", action="store_true",
                        help="Without CUDA, run the whole loop on CPU (tiny sizes, with --num-hidden-layers): what "
                             "gpu_check.sh --rehearse runs so that a GPU call does not fail on a typo.")
    parser.add_argument("--out", required=True, help="JSON file of the results ('-' with --attempt).")
    cli = parser.parse_args()
    try:
        cli.unchecked_layers = {v: int(n) for v, n in (item.split("=", 1) for item in cli.unchecked_layers)}
    except ValueError:
        parser.error(f"--unchecked-layers takes VARIANT=N items, got {cli.unchecked_layers}")

    if cli.attempt:
        arch, shape = model_shape(cli.model)
        shape.update({"num_hidden_layers": cli.num_hidden_layers} if cli.num_hidden_layers else {})
        record = attempt(cli.trainers[0], cli.impls[0], cli.start_prompt_length, cli.steps, cli.response_length,
                         cli.shared_k, profile=cli.profile, shape=shape, long_rows=cli.long_rows,
                         memory_cap_gib=cli.memory_cap_gib, variant=cli.variants[0], arch=arch,
                         unchecked_layers=cli.unchecked_layers.get(cli.variants[0]),
                         model_name=cli.model, lora_r=cli.lora_r, memory_sites=cli.memory_sites)
        print("RESULT " + json.dumps(record), flush=True)
        return

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not cli.rehearse:
        raise SystemExit("gpu_longest_row.py needs a CUDA device; none is visible.")
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": common.software_versions(),
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu (rehearsal)",
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "model": f"qwen3 random init, bf16, {QWEN3_0_6B}",
        **({"gemm": json.loads(Path(cli.gemm_report).read_text())["gemm"]}
           if cli.gemm_report and Path(cli.gemm_report).exists() else {}),
        "longest_row": [],
        "throughput": [],
        "profile": None,
        "long_rows": [],
        "variant_profiles": {},
        **({"memory_cap_gib": cli.memory_cap_gib} if cli.memory_cap_gib is not None else {}),
    }
    out = Path(cli.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if cli.resume and out.exists():
        previous = json.loads(out.read_text())
        if previous.get("memory_cap_gib") != cli.memory_cap_gib:
            raise SystemExit(f"{out} holds runs under memory_cap_gib={previous.get('memory_cap_gib')}, not "
                             f"{cli.memory_cap_gib}: resume it with the same cap, or write another report.")
        report["throughput"] = [r for r in previous["throughput"] if r["status"] in ("ok", "oom")]
        report["longest_row"] = previous["longest_row"]
        report["profile"] = previous.get("profile")
        report["variant_profiles"] = {v: r for v, r in previous.get("variant_profiles", {}).items() if r.get("profile")}
        report["long_rows"] = [r for r in previous.get("long_rows", []) if r["status"] in ("ok", "oom")]
        report.setdefault("gemm", previous.get("gemm"))
    done = {run_key(r) for r in report["throughput"]}
    searched = {(r["trainer"], r["impl"]) for r in report["longest_row"]}

    def save():
        out.write_text(json.dumps(report, indent=1))
        # gpu.json's summary is summary.json; another report's is named after it.
        name = "summary.json" if out.name == "gpu.json" else f"{out.stem}_summary.json"
        (out.parent / name).write_text(json.dumps(summary(report), indent=1))

    print(json.dumps({k: report[k] for k in ("versions", "gpu", "gpu_memory_gib")}), flush=True)
    for length in cli.throughput_prompt_lengths:
        for trainer in cli.trainers:
            runs = [(impl, 1, "default") for impl in cli.impls if "default" in cli.variants or impl != "ours"]
            runs += [("ours", cli.shared_k, "default")] if ("ours", 1, "default") in runs and cli.shared_k > 1 else []
            # (Variants at k = 1, or at --shared-k where k = 1 is skipped: the 8B runs.)
            variant_k = cli.shared_k if cli.skip_k1 else 1
            runs += [("ours", variant_k, v) for v in cli.variants if v != "default" and "ours" in cli.impls]
            if cli.skip_k1:
                runs = [run for run in runs if run[0] != "ours" or run[1] != 1 or cli.shared_k == 1]
            for impl, k, variant in runs:
                long_rows = cli.long_rows and impl == "ours"
                key = run_key({"trainer": trainer, "impl": impl, "prompt_length": length, "num_rejected": k,
                               "variant": variant, "model": cli.model, "lora_r": cli.lora_r, "long_rows": long_rows,
                               "num_hidden_layers": cli.num_hidden_layers})
                if key not in done:
                    record = run_attempt(trainer, impl, length, cli.steps, cli, k, variant=variant,
                                         profile=cli.profile, long_rows=long_rows)  # fmt: skip
                    report["throughput"].append(record)
                    save()
                    if record["status"] == "oom" and variant in cli.unchecked_layers and cli.unchecked_fallback:
                        # The plan's proposal did not fit: once more with fewer layers unchecked (a record of its own).
                        fewer = max(cli.unchecked_layers[variant] - cli.unchecked_fallback, 0)
                        retry = argparse.Namespace(**{**vars(cli), "unchecked_layers": {**cli.unchecked_layers,
                                                                                        variant: fewer}})
                        report["throughput"].append(run_attempt(trainer, impl, length, cli.steps, retry, k,
                                                                variant=variant, profile=cli.profile,
                                                                long_rows=long_rows))  # fmt: skip
                        save()
    if cli.profile_prompt_length and not (report["profile"] or {}).get("profile"):
        report["profile"] = run_attempt("grm", "ours", cli.profile_prompt_length, 2, cli, 1, profile=True)
        save()
        print(json.dumps(report["profile"].get("profile"), indent=1), flush=True)
    for variant in cli.profile_variants:
        if cli.profile_prompt_length and variant not in report["variant_profiles"]:
            report["variant_profiles"][variant] = run_attempt("grm", "ours", cli.profile_prompt_length, 2, cli, 1,
                                                              profile=True, variant=variant)
            save()
    settings = {"both": (False, True), "without": (False,), "with": (True,)}[cli.long_rows_settings]
    for length in cli.long_rows_prompt_lengths:
        for long_rows in settings:
            if not any(r["prompt_length"] == length and bool(r.get("long_rows")) == long_rows
                       for r in report["long_rows"]):  # fmt: skip
                report["long_rows"].append(run_attempt("grm", "ours", length, cli.steps, cli, 1, long_rows=long_rows))
                save()
    if not cli.skip_longest:
        for trainer in cli.trainers:
            for impl in sorted(cli.impls, key=lambda impl: impl != "stock"):  # stock first: ours may start from it
                if (trainer, impl) in searched:
                    continue
                search = cli
                stock = next((r for r in report["longest_row"] if (r["trainer"], r["impl"]) == (trainer, "stock")), None)
                if impl == "ours" and cli.ours_at_stock_multiple and stock and stock["longest_prompt_length"]:
                    # One attempt at the target itself (ours' longest >= multiple x stock's): a search up to ours'
                    # own limit takes minutes per step at these lengths. The ratio is then a lower bound.
                    target = int(cli.ours_at_stock_multiple * stock["longest_prompt_length"]) // 1024 * 1024
                    search = argparse.Namespace(**{**vars(cli), "start_prompt_length": target,
                                                   "max_prompt_length": target})  # fmt: skip
                report["longest_row"].append(longest_row(trainer, impl, search, report["throughput"]))
                save()
    for row in report["longest_row"]:
        print(f"longest row {row['trainer']:5s} {row['impl']:5s}: prompt {row['longest_prompt_length']} "
              f"({row['longest_row_tokens']} tokens per row); first failure at {row['first_failing_prompt_length']}")
    print(json.dumps(summary(report)))


if __name__ == "__main__":
    main()
