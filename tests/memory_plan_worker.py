"""Measured side of tests/test_memory_plan.py: the peak tensor memory of the step a memory plan predicts, from a real
run on CPU (`bench/tensor_memory.py`'s recorder of allocator events), on one process or on each gloo rank."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from tensor_memory import TensorMemoryRecorder, allocator_events  # noqa: E402

from trl_longrm.memory.activation_offload import CountingHostStore, use_host_store  # noqa: E402
from trl_longrm.memory_plan.model import build_model  # noqa: E402
from trl_longrm.memory_plan.trace import GroupShape, fresh_args, synthetic_dataset  # noqa: E402
from trl_longrm.stages import stage_classes  # noqa: E402
from trl_longrm.testing_utils import build_chat_tokenizer  # noqa: E402


def load_4bit(stage: str, path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                      bnb_4bit_use_double_quant=True)  # fmt: skip
    cls = AutoModelForSequenceClassification if stage == "simpo_disrm" else AutoModelForCausalLM
    return cls.from_pretrained(path, quantization_config=quantization, dtype=dtype, device_map="cpu")


def measure_step(stage, training_args, model_config, shape: GroupShape, peft_config=None, dtype=None,
                 num_rows_per_step: int = 1, host_store: CountingHostStore | None = None,
                 stock: bool = False, load_in_4bit: bool = False, steps: int = 2, on_trained=None,
                 with_stack: bool = True) -> int:  # fmt: skip
    """Peak live tensor bytes of the second optimizer step (the first that starts with the optimizer's states, as
    every later one does) of `stage`'s trainer (`stock`: stock TRL's, on its pairs), on this process; the memory plan
    traces that step. `steps`: the step measured is the last of `steps` (DeepSpeed ZeRO-3 settles in its third: see
    `measure_deepspeed_on_rank`). `on_trained(trainer)` is called after training. `with_stack=False`: the recorder
    keeps no Python callers (same peak, less overhead). `load_in_4bit`: the model saved and loaded again in 4 bits by
    bitsandbytes (NF4, nested absmax, the compute dtype `dtype`), as a QLoRA recipe loads it. It is loaded before the
    recorder starts (the profiler sees the load's file-backed storage allocated but never freed), and the bytes of the
    loaded tensors the model still holds at the step are added to the recorded peak (the 4-bit weights, their
    quantization states, and whatever k-bit preparation did not replace)."""
    tokenizer = build_chat_tokenizer()
    accumulation = min(training_args.gradient_accumulation_steps, 2)
    saved = tempfile.TemporaryDirectory()
    if load_in_4bit:
        torch.manual_seed(0)
        build_model(stage, model_config, dtype).save_pretrained(saved.name)
    loaded = {}
    if load_in_4bit:
        model = load_4bit(stage, saved.name, dtype)
        loaded = model_tensor_bytes(model)
    recorder = TensorMemoryRecorder(with_stack=with_stack)
    recorder.start()  # before the model exists: its weights are live tensors of every step
    torch.manual_seed(0)
    if not load_in_4bit:
        model = build_model(stage, model_config, dtype)
    rows = 2 * accumulation * num_rows_per_step
    with tempfile.TemporaryDirectory() as tmp:
        overrides = dict(output_dir=tmp, max_steps=steps, gradient_accumulation_steps=accumulation, save_strategy="no",
                         report_to=[], disable_tqdm=True, logging_steps=1)  # fmt: skip
        if stock:
            from trl_longrm.memory_plan.stock import stock_args, stock_classes, stock_dataset

            trainer_cls = stock_classes(stage)[0]
            args = stock_args(stage, training_args, shape, **overrides)
            groups = -(-rows // max(shape.num_rejected, 1))
            if stage == "sft":  # the same examples as ours
                dataset = synthetic_dataset(stage, shape, rows, model_config.vocab_size, tokenizer.eos_token_id)
            else:
                dataset = stock_dataset(stage, shape, groups, model_config.vocab_size, tokenizer.eos_token_id)
        else:
            trainer_cls = stage_classes(stage)[0]
            args = fresh_args(training_args, **overrides)
            dataset = synthetic_dataset(stage, shape, rows, model_config.vocab_size, tokenizer.eos_token_id)
        trainer = trainer_cls(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
            callbacks=[recorder],
        )  # fmt: skip
        # Offloaded activations go to a counting store (meta tensors, no allocation): on CPU a real host copy would be
        # in the same allocator as the device tensors; the plan reports host memory apart, so the measure must too.
        with use_host_store(host_store or CountingHostStore()):
            trainer.train()
        if on_trained is not None:
            on_trained(trainer)
    report = recorder.finish(steps)
    held = model_tensor_bytes(trainer.model)
    return report[steps - 1]["peak_bytes"] + sum(size for ptr, size in loaded.items() if ptr in held)


def model_tensor_bytes(model) -> dict[int, int]:
    """Bytes of the storages a model holds (parameters, buffers, and bitsandbytes' quantization states), by address."""
    tensors = [*model.parameters(), *model.buffers()]
    states = [getattr(p, "quant_state", None) for p in model.parameters()]
    while states:
        state = states.pop()
        if state is not None:
            tensors += [t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor)]
            states.append(state.state2)
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def measure_on_rank(rank: int, world_size: int, out_dir: str, case: dict) -> None:
    """`run_on_gloo_ranks` entry: `measure_step` of `case` (see tests/test_memory_plan.py `build_case`) on this rank,
    written to `out_dir/rank{rank}.json`."""
    from test_memory_plan import build_case  # tests/ is on the path of the forked worker, as of pytest

    from trl_longrm.sequence_parallel.launch import set_distributed_env

    set_distributed_env(rank, world_size)
    stage, args, model_config, shape, peft_config, dtype, rows = build_case(**case)
    peak = measure_step(stage, args, model_config, shape, peft_config, dtype, rows)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak_bytes": peak}))


def measure_deepspeed_on_rank(rank: int, world_size: int, out_dir: str, case: dict) -> None:
    """`run_on_gloo_ranks` entry: `measure_step` of ZeRO case `case["name"]` (tests/test_memory_plan.py ZERO_CASES)
    under DeepSpeed, launched as `accelerate launch` launches it from an accelerate YAML whose `deepspeed_config_file`
    names the case's DeepSpeed config (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE; set before the
    training arguments are built, which read them). Writes `out_dir/rank{rank}.json`: the peak, and the ZeRO sizes the
    engine resolved its config to (`"auto"` filled in by the HF Trainer), which the plan must have read the same.

    The step measured is the third under ZeRO-3: its parameter coordinator records the module order in the second
    (`PartitionedParameterCoordinator.reset_step`: invalid, then recording, then complete) and only then prefetches
    and keeps parameters by reuse distance, as every later step does. Python's cyclic GC is off, as DeepSpeed's
    hooks make cycles whose collection would otherwise free tensors at times that vary from run to run."""
    import gc
    import os

    from test_memory_plan import ZERO_CASES, build_case

    from trl_longrm.sequence_parallel.launch import set_distributed_env

    gc.disable()
    set_distributed_env(rank, world_size)
    _, config, steps = ZERO_CASES[case["name"]]
    path = Path(out_dir, f"deepspeed_rank{rank}.json")
    path.write_text(json.dumps(config))
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=str(path))
    stage, args, model_config, shape, peft_config, dtype, rows = build_case(case["name"])
    resolved = {}

    def read_config(trainer):
        zero = trainer.deepspeed._config.zero_config
        resolved.update(stage=int(zero.stage), reduce_bucket_size=int(zero.reduce_bucket_size),
                        overlap_comm=bool(zero.overlap_comm), contiguous_gradients=bool(zero.contiguous_gradients),
                        prefetch_bucket_size=int(zero.prefetch_bucket_size),
                        param_persistence_threshold=int(zero.param_persistence_threshold),
                        max_reuse_distance=int(zero.max_reuse_distance),
                        offload_optimizer=device(zero.offload_optimizer), offload_param=device(zero.offload_param))  # fmt: skip

    def device(offload):
        value = getattr(offload, "device", None)
        return str(getattr(value, "value", value) or "none")

    peak = measure_step(stage, args, model_config, shape, peft_config, dtype, rows, steps=steps, on_trained=read_config,
                        with_stack=False)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak_bytes": peak, "zero": resolved}))


def collectives_on_rank(rank: int, world_size: int, out_dir: str, rounds: int) -> None:
    """`run_on_gloo_ranks` entry: under a `TensorMemoryRecorder`, `rounds` times what a gloo ring run does with
    buffers that only a collective's work holds: DDP's broadcast of its module states (through a flat bucket), the
    ring's all-gather of a temporary and its reduce-scatter (gloo reduces a copy). Writes `out_dir/rank{rank}.json`
    with the bytes whose free the recorder did not see (still live at the end of its events, or their address handed
    out again while live): all of them are freed."""
    import torch.distributed as dist

    from trl_longrm.sequence_parallel.collectives import reduce_scatter_dim0, start_all_gather_dim0

    states = [torch.randn(256, 256) for _ in range(8)]  # 2 MiB, allocated before the recorder starts
    chunk = torch.randn(1024, 64)
    recorder = TensorMemoryRecorder()
    recorder.start()
    for _ in range(rounds):
        dist._broadcast_coalesced(dist.group.WORLD, states, 250 * 2**20, 0)
        gathered, work = start_all_gather_dim0(torch.cat([chunk, chunk]), dist.group.WORLD)
        work.wait()
        del gathered, work
        reduce_scatter_dim0(chunk, dist.group.WORLD)
    recorder.finish(0)
    live, unseen = {}, 0
    for _, ptr, size, _, _ in allocator_events(recorder.profiler):
        if size > 0:
            unseen += live.get(ptr, 0)
            live[ptr] = size
        else:
            live.pop(ptr, None)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"unseen_free_bytes": unseen + sum(live.values())}))
