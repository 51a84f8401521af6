"""accelerate's `parallelism_config` read as our sequence parallelism.

TRL users reach DeepSpeed's Ulysses through accelerate: `ParallelismConfig(sp_backend="deepspeed", sp_size=N)` in
the training arguments, or a `parallelism_config` section in an accelerate YAML (which `accelerate launch` passes as
`PARALLELISM_CONFIG_*` variables). Left to accelerate, its Ulysses replaces the model's attention with DeepSpeed's and
wraps the dataloader, which our packed rows, shared prefixes and attention do not survive. So our configs take the
request over at construction: `sp_size = N` becomes `sequence_parallel_size = N`, `sequence_parallel_mode =
'ulysses'` (the same all-to-all over heads, over the same groups of N consecutive ranks, with data-parallel replicas
of N ranks seeing different rows), and accelerate receives a parallelism config without it. torch's context
parallelism (`cp_size`) needs FSDP2 and attention of its own: it is refused, pointing to `sequence_parallel_size`.
"""

from __future__ import annotations

import os


USE_PARALLELISM_CONFIG_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"
ENV_PREFIX = "PARALLELISM_CONFIG_"
# DeepSpeed's Ulysses attention implementations and the kernels of ours that compute the same attention.
SP_ATTENTION_BACKENDS = {"sdpa": "torch", "flash_attention_2": "flash_attn"}


def _requested(config) -> tuple[dict, object | None, str] | None:
    """`(sizes and backends, sp_handler, where it was set)` of the parallelism accelerate would apply, or None."""
    pc = getattr(config, "parallelism_config", None)
    names = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
    if pc is not None:
        values = {f"{n}_size": int(getattr(pc, f"{n}_size") or 1) for n in names}
        values.update(sp_backend=pc.sp_backend or "deepspeed", cp_backend=pc.cp_backend or "torch")
        return values, getattr(pc, "sp_handler", None), "parallelism_config"
    if os.environ.get(USE_PARALLELISM_CONFIG_ENV, "false").lower() != "true":
        return None
    values = {f"{n}_size": int(os.environ.get(f"{ENV_PREFIX}{n.upper()}_SIZE", "1")) for n in names}
    values.update(
        sp_backend=os.environ.get(f"{ENV_PREFIX}SP_BACKEND", "deepspeed"),
        cp_backend=os.environ.get(f"{ENV_PREFIX}CP_BACKEND", "torch"),
    )
    return values, None, f"the accelerate config's parallelism_config ({ENV_PREFIX}* variables)"


def absorb_accelerate_parallelism(config) -> None:
    """Read accelerate's sequence/context parallelism request on a trainer config (in its `__post_init__`) as ours.

    Sets `sequence_parallel_size` / `sequence_parallel_mode` (and `ring_attn_backend` from the `sp_handler`'s attention)
    and replaces `config.parallelism_config` by one without `sp_size`, so that accelerate does not apply its own
    Ulysses as well; raises, naming the fields, for what cannot be honoured or disagrees with our fields.

    Example:
    ```python
    >>> from accelerate import ParallelismConfig
    >>> args = SimPODisRMConfig(output_dir="rm", parallelism_config=ParallelismConfig(sp_size=4, sp_backend="deepspeed"))
    >>> args.sequence_parallel_size, args.sequence_parallel_mode
    (4, 'ulysses')
    ```
    """
    requested = _requested(config)
    if requested is None:
        return
    values, handler, source = requested
    sp, cp = values["sp_size"], values["cp_size"]
    if cp > 1:
        raise ValueError(
            f"{source} sets cp_size={cp}: accelerate's context parallelism (torch's, under FSDP2, with its own "
            f"attention) cannot run our packed rows and shared prefixes. Set sequence_parallel_size={cp} on "
            f"{type(config).__name__} instead (sequence_parallel_mode='ring' is our context parallelism, 'ulysses' "
            "DeepSpeed's all-to-all over heads), and remove cp_size."
        )
    if sp <= 1:
        return
    if values["sp_backend"] != "deepspeed":
        raise ValueError(f"{source} sets sp_backend={values['sp_backend']!r}; only 'deepspeed' (Ulysses) is known.")
    others = {k: v for k, v in values.items() if k in ("dp_shard_size", "tp_size") and v > 1}
    if others:
        listed = ", ".join(f"{k}={v}" for k, v in others.items())
        raise ValueError(
            f"{source} sets sp_size={sp} with {listed}: our sequence parallelism composes with data-parallel replicas "
            "(DDP or DeepSpeed ZeRO over the world size / sp_size groups), not with FSDP sharding or tensor "
            "parallelism. Remove them, or sp_size."
        )
    if config.sequence_parallel_size not in (1, sp):
        raise ValueError(
            f"{source} sets sp_size={sp} but {type(config).__name__}.sequence_parallel_size="
            f"{config.sequence_parallel_size}: they name the same group and must agree. Set one of them."
        )
    if config.sequence_parallel_mode not in (None, "ulysses"):
        raise ValueError(
            f"{source} sets sp_size={sp}, DeepSpeed's Ulysses, but sequence_parallel_mode="
            f"{config.sequence_parallel_mode!r}. Drop sp_size and use sequence_parallel_size={sp} with that mode, "
            "or leave sequence_parallel_mode unset (or 'ulysses')."
        )
    attention = getattr(handler, "sp_attn_implementation", None) if handler is not None else None
    if attention is not None:
        backend = SP_ATTENTION_BACKENDS.get(attention)
        if backend is None:
            raise ValueError(
                f"{source}: sp_handler.sp_attn_implementation={attention!r} cannot be honoured: our attention computes "
                f"the packed rows' masks with its own kernels, {sorted(SP_ATTENTION_BACKENDS)} map to them "
                "(ring_attn_backend 'torch' / 'flash_attn'). Use one of those, or leave it unset."
            )
        if config.ring_attn_backend not in ("auto", backend):
            raise ValueError(
                f"{source}: sp_handler.sp_attn_implementation={attention!r} asks for ring_attn_backend={backend!r}, "
                f"but ring_attn_backend={config.ring_attn_backend!r} is set. Set one of them."
            )
        config.ring_attn_backend = backend
    config.sequence_parallel_size = sp
    config.sequence_parallel_mode = "ulysses"
    config._accelerate_replicas = values["dp_replicate_size"]  # checked against the world size by the trainer
    from accelerate import ParallelismConfig

    # Every size given, so that accelerate reads nothing from the PARALLELISM_CONFIG_* variables; the replicas are
    # left to accelerate (DDP or DeepSpeed over the world, our trainers shard the rows per replica).
    config.parallelism_config = ParallelismConfig(
        dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=1, sp_size=1, cp_backend="torch",
        sp_backend="deepspeed",
    )  # fmt: skip
