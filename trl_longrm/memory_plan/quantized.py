"""4-bit (QLoRA) models in the memory plan.

bitsandbytes' 4-bit layers do not run on fake tensors, so a QLoRA recipe's step is traced with its frozen weights in
the compute dtype, standing for the 4-bit ones, on a model that goes through the trainer as a 4-bit load does
(`loaded_in_4bit`: TRL's k-bit preparation, which casts what is not in 4 bits to float32 in CPOTrainer), whose 4-bit
layers compute as bitsandbytes' and PEFT's 4-bit classes do (`as_4bit_layers`: the dequantized weight of each call,
outputs in their input's dtype, PEFT's clone of the base output and its adapter-input casts). The bytes of the
quantized weights are then replaced by what bitsandbytes stores for them (`quantize_plan`, `bnb_4bit_bytes`): packed
4-bit values, one absmax per block of 64, with nested quantization those absmaxes in 8 bits plus a float32 absmax per
256 of them, and the code tables. Checked against a bitsandbytes model's own bytes, and its training step's measured
peak, in tests/test_memory_plan.py.
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
    from trl_longrm.memory_plan.model import build_model

    with torch.device("meta"):
        model = build_model(stage, model_config, torch.bfloat16)
    kept = _kept_in_full_precision(model)
    return [
        module.weight.numel()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not any(name == k or name.endswith("." + k) for k in kept)
    ]


# Marks, on a traced model's modules, the linear layers a 4-bit load quantizes (`loaded_in_4bit`).
QUANTIZED_MARK = "_longrm_traced_4bit"


def _kept_in_full_precision(model) -> set[str]:
    from transformers.quantizers.base import get_keys_to_not_convert

    return set(get_keys_to_not_convert(model) or [])


def loaded_in_4bit(model) -> int:
    """Make a model built in the compute dtype (fake weights) go through the trainers as a bitsandbytes 4-bit load
    does: `is_loaded_in_4bit`, which makes TRL's trainers prepare it for k-bit training (CPOTrainer:
    `prepare_model_for_kbit_training`, every parameter not in 4 bits to float32, then `peft_module_casting_to_bf16`;
    SFTTrainer and RewardTrainer: the adapters to bf16), and a mark on each linear layer the load would quantize
    (`as_4bit_layers` then gives them back their 4-bit layers' behaviour). Returns how many are marked."""
    kept = _kept_in_full_precision(model)
    marked = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not any(name == k or name.endswith("." + k) for k in kept):
            setattr(module, QUANTIZED_MARK, True)
            marked += 1
    model.is_loaded_in_4bit = True
    return marked


class _Matmul4bit(torch.autograd.Function):
    """bitsandbytes' `MatMul4Bit` on a weight that stands for a 4-bit one: each call dequantizes it (a weight-sized
    tensor in the input's dtype, and with nested quantization the float32 absmax of each block of 64), in forward
    and again for the input's gradient in backward; the input is not saved (`ctx.tensors = (None, B)`)
    (bitsandbytes/autograd/_functions.py, backends/default/ops.py `_gemm_4bit_default_impl`)."""

    @staticmethod
    def forward(ctx, x, weight, nested):
        ctx.weight, ctx.nested = weight, nested
        dequantized = _dequantized(weight, x.dtype, nested)
        return torch.nn.functional.linear(x, dequantized)

    @staticmethod
    def backward(ctx, grad):
        return torch.matmul(grad, _dequantized(ctx.weight, grad.dtype, ctx.nested)), None, None


def _dequantized(weight, dtype, nested):
    absmax = torch.empty(-(-weight.numel() // BNB_BLOCKSIZE), dtype=torch.float32) if nested else None
    out = torch.empty(weight.shape, dtype=dtype)
    del absmax
    return out


def _linear_4bit_forward(self, x):
    # bitsandbytes' `Linear4bit.forward`: the input in the compute dtype, the output in the input's dtype (float32
    # where the input is: a float32 norm before it makes the residual stream float32).
    dtype = x.dtype
    return _Matmul4bit.apply(x.to(self._longrm_compute_dtype), self.weight, self._longrm_nested).to(dtype)


def _lora_4bit_forward(self, x, *args, **kwargs):
    # PEFT's `lora.bnb.Linear4bit.forward` (vanilla LoRA): the base output cloned ("defensively"), and the adapter's
    # input cast to its dtype unless `torch.is_autocast_enabled()`, which without a device is CUDA's: on a CPU run
    # always cast, on a CUDA run under bf16 autocast never (`self._longrm_autocast` reads the flag the run reads).
    result = self.base_layer(x, *args, **kwargs).clone()
    for name in self.active_adapters:
        if name not in self.lora_A.keys():
            continue
        lora_A, lora_B = self.lora_A[name], self.lora_B[name]
        convert = not self._longrm_autocast()
        adapter_input = x.to(lora_A.weight.dtype) if convert and x.dtype != lora_A.weight.dtype else x
        output = lora_B(lora_A(self.lora_dropout[name](adapter_input))) * self.scaling[name]
        result = result + (output.to(result.dtype) if convert else output)
    return result


def as_4bit_layers(model, compute_dtype: torch.dtype, nested: bool = True, device: str = "cpu") -> None:
    """After the trainer prepared a `loaded_in_4bit` model: each marked layer computes as bitsandbytes' `Linear4bit`
    (its weight in the compute dtype standing for the 4-bit one, which k-bit preparation does not cast; dequantized
    at each call, `_Matmul4bit`), and each LoRA layer over one as PEFT's `lora.bnb.Linear4bit` (`_lora_4bit_forward`)
    on `device` ('cpu' or 'cuda': which autocast flag PEFT's check reads in the run)."""
    import types

    for module in model.modules():
        if getattr(module, QUANTIZED_MARK, False):
            if module.weight.dtype != compute_dtype:
                module.weight = torch.nn.Parameter(module.weight.to(compute_dtype), requires_grad=False)
            module._longrm_compute_dtype, module._longrm_nested = compute_dtype, nested
            module.forward = types.MethodType(_linear_4bit_forward, module)
    # The trace runs on CPU: its CPU autocast stands for a CUDA run's.
    autocast = (lambda: torch.is_autocast_enabled("cpu")) if device == "cuda" else (lambda: torch.is_autocast_enabled("cuda"))
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if base is not None and getattr(base, QUANTIZED_MARK, False) and hasattr(module, "lora_A"):
            if getattr(module, "lora_variant", None):
                raise NotImplementedError("memory plan of QLoRA: only vanilla LoRA adapters (no DoRA) are planned")
            module._longrm_autocast = autocast
            module.forward = types.MethodType(_lora_4bit_forward, module)


def quantize_plan(plan, stage: str, model_config, nested: bool, element_size: int, fragmentation: float = 0.0):
    """`plan` (traced with the quantized weights in a dtype of `element_size` bytes) with those weights in 4 bits."""
    numels = quantized_weight_numels(stage, model_config)
    saved = sum(numels) * element_size - sum(bnb_4bit_bytes(n, nested) for n in numels)
    extra = dict(plan.extra)
    peak = plan.peak - saved
    if "allocator_fragmentation" in extra:  # `fragmentation` of the rest (plan.CUDA_FRAGMENTATION_FRACTION)
        change = -int(fragmentation * saved)
        extra["allocator_fragmentation"] += change
        peak += change
    note = (f"{len(numels)} weights in 4 bits ({'nested' if nested else 'plain'} absmax): traced in the compute dtype, "
            f"{saved / 2**30:.2f} GiB less")  # fmt: skip
    return dataclasses.replace(plan, weights=plan.weights - saved, extra=extra, peak=peak, notes=[*plan.notes, note])
