"""`save_merged_model`: the base model with a trained LoRA adapter merged in, saved as a plain checkpoint.

With LoRA, PEFT's `merge_and_unload` adds the adapter's delta to the base weights. With QLoRA that is not enough:
merging into a 4-bit layer re-quantises the merged weight, so the result is still an NF4 checkpoint (needing
bitsandbytes to load) and the adapter's delta is rounded to 4 bits with it. A user who asks for a merged model
expects a plain model that the next stage or any tool loads as is, so a quantised base is first dequantised (the
weights training saw, in the compute dtype) and the adapter is merged in that precision.
"""

from __future__ import annotations

import logging
from pathlib import Path


logger = logging.getLogger(__name__)


def merged_dtype(training_args, model_args):
    """The dtype a dequantised base is merged and saved in: bf16 with `bf16=True`, else the model's `dtype` when one
    is named, else float32."""
    import torch

    if getattr(training_args, "bf16", False):
        return torch.bfloat16
    if getattr(training_args, "fp16", False):
        return torch.float16
    if model_args.dtype not in (None, "auto"):
        return getattr(torch, model_args.dtype)
    return torch.float32


def save_merged_model(peft_model, adapter_dir: str | Path, merged_dir: str | Path, load_base, dtype) -> Path:
    """Save `peft_model`'s base with its adapter merged into `merged_dir`.

    `adapter_dir` holds the saved adapter; `load_base()` loads the base model as training did (with its quantisation
    config). A quantised base is reloaded, dequantised to `dtype` and merged with the adapter read back from
    `adapter_dir`; an unquantised one is merged in place.

    Example:
    ```python
    >>> save_merged_model(trainer.model, "out", "out/merged", load_base=lambda: load_model(...), dtype=torch.bfloat16)
    ```
    """
    from peft import PeftModel

    merged_dir = Path(merged_dir)
    base = peft_model.get_base_model()
    if getattr(base, "is_quantized", False) or getattr(base.config, "quantization_config", None) is not None:
        fresh = load_base().dequantize(dtype=dtype)
        merged = PeftModel.from_pretrained(fresh, str(adapter_dir)).merge_and_unload()
        logger.info("Merged the adapter into the dequantised base (%s): %s", dtype, merged_dir)
    else:
        merged = peft_model.merge_and_unload()
    merged.save_pretrained(merged_dir)
    return merged_dir
