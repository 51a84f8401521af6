"""4-bit (QLoRA) weights in the memory plan.

bitsandbytes' 4-bit layers do not run on fake tensors, so a QLoRA recipe's step is traced with its frozen weights in
the compute dtype (the LoRA adapters, activations and everything else as the run has them), and the bytes of the
weights bitsandbytes quantizes are then replaced by what it stores for them (`bnb_4bit_bytes`): packed 4-bit values,
one absmax per block of 64, with nested quantization those absmaxes in 8 bits plus a float32 absmax per 256 of them,
and the code tables. A named term adds the one weight a 4-bit layer dequantizes to the compute dtype for its matmul
(`qlora_dequantized_weight`, the largest). Checked against a bitsandbytes model's own bytes in
tests/test_memory_plan.py.
"""

from __future__ import annotations

import dataclasses

import torch


BNB_BLOCKSIZE = 64  # bitsandbytes' 4-bit quantization block (transformers' default `bnb_4bit_blocksize`)
NESTED_BLOCKSIZE = 256  # nested ("double") quantization of the absmaxes
CODE_4BIT_BYTES = 16 * 4  # the float32 code table of the 16 NF4/FP4 values
CODE_8BIT_BYTES = 256 * 4  # the float32 code table of the nested 8-bit absmaxes


def bnb_4bit_bytes(numel: int, nested: bool) -> int:
    """Bytes bitsandbytes holds for a weight of `numel` values in 4 bits (values, absmaxes, code tables)."""
    blocks = -(-numel // BNB_BLOCKSIZE)
    packed = -(-numel // 2)
    if not nested:
        return packed + 4 * blocks + CODE_4BIT_BYTES
    return packed + blocks + 4 * -(-blocks // NESTED_BLOCKSIZE) + 4 + CODE_4BIT_BYTES + CODE_8BIT_BYTES


def quantized_weight_numels(stage: str, model_config) -> list[int]:
    """The sizes of the weights a 4-bit load quantizes: every `nn.Linear` but those transformers keeps in full
    precision (the output head, `get_keys_to_not_convert`), from a skeleton on the meta device."""
    from transformers.quantizers.base import get_keys_to_not_convert

    from trl_longrm.memory_plan.trace import build_model

    with torch.device("meta"):
        model = build_model(stage, model_config, torch.bfloat16)
    kept = set(get_keys_to_not_convert(model) or [])
    return [
        module.weight.numel()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not any(name == k or name.endswith("." + k) for k in kept)
    ]


def quantize_plan(plan, stage: str, model_config, nested: bool, element_size: int):
    """`plan` (traced with the quantized weights in a dtype of `element_size` bytes) with those weights in 4 bits."""
    numels = quantized_weight_numels(stage, model_config)
    saved = sum(numels) * element_size - sum(bnb_4bit_bytes(n, nested) for n in numels)
    dequantized = max(numels) * element_size
    extra = dict(plan.extra)
    extra["qlora_dequantized_weight"] = dequantized
    peak = plan.peak - saved + dequantized
    if "allocator_fragmentation" in extra:  # a fraction of the rest (plan.CUDA_FRAGMENTATION_FRACTION)
        from trl_longrm.memory_plan.plan import CUDA_FRAGMENTATION_FRACTION

        change = int(CUDA_FRAGMENTATION_FRACTION * (dequantized - saved))
        extra["allocator_fragmentation"] += change
        peak += change
    note = (f"{len(numels)} weights in 4 bits ({'nested' if nested else 'plain'} absmax): traced in the compute dtype, "
            f"{saved / 2**30:.2f} GiB less")  # fmt: skip
    return dataclasses.replace(plan, weights=plan.weights - saved, extra=extra, peak=peak, notes=[*plan.notes, note])
