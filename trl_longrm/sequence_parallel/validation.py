"""Checks that fail before training, with a clear message, on configurations the ring attention cannot run."""

from __future__ import annotations

from .config import RING_ATTENTION_BACKENDS, SequenceParallelConfig, ulysses_group_size
from .groups import check_sequence_parallel_size


def check_ring_head_stride(
    ring_head_stride: int | None, num_key_value_heads: int, model_key_value_heads: int | None = None, ulysses_size: int = 1
) -> None:
    """Raise unless `ring_head_stride` (None = all heads) divides `num_key_value_heads`, the key/value heads the ring
    passes on one rank: the model's (`model_key_value_heads`, default the same), or its share after a Ulysses
    exchange over `ulysses_size` ranks.

    Example:
    ```python
    >>> check_ring_head_stride(2, 8)  # fine
    >>> check_ring_head_stride(3, 8)  # raises ValueError
    ```
    """
    if ring_head_stride is None:
        return
    if not isinstance(ring_head_stride, int) or ring_head_stride < 1 or num_key_value_heads % ring_head_stride:
        divisors = [d for d in range(1, num_key_value_heads + 1) if num_key_value_heads % d == 0]
        if ulysses_size > 1:
            model_heads = num_key_value_heads if model_key_value_heads is None else model_key_value_heads
            held = (
                f"the {num_key_value_heads} key/value heads each rank holds after the Ulysses exchange (the model's "
                f"{model_heads} over a Ulysses group of {ulysses_size}"
                + (", each head replicated" if model_heads < ulysses_size else "")
                + ")"
            )
        else:
            held = f"the model's number of key/value heads ({num_key_value_heads})"
        raise ValueError(
            f"ring_head_stride={ring_head_stride!r} must divide {held}; valid values: {divisors} (or None for all "
            "heads at once)."
        )


def check_ulysses_heads(num_heads: int, num_kv_heads: int, ulysses_size: int, model_name: str = "the model") -> None:
    """Raise unless a Ulysses group of `ulysses_size` ranks can share the heads: the query heads split evenly, and the
    key/value heads either split evenly or (fewer key/value heads than ranks) each serve a whole number of ranks.

    Example:
    ```python
    >>> check_ulysses_heads(32, 8, 4, "Llama")  # 8 query / 2 key/value heads per rank
    >>> check_ulysses_heads(32, 8, 16, "Llama")  # fine: each key/value head replicated on 2 ranks
    >>> check_ulysses_heads(12, 2, 8, "Model")  # raises ValueError
    ```
    """
    if ulysses_size <= 1:
        return
    works = lambda u: num_heads % u == 0 and (num_kv_heads % u == 0 or u % num_kv_heads == 0)  # noqa: E731
    if works(ulysses_size):
        return
    sizes = [u for u in range(2, num_heads + 1) if works(u)]
    reason = (
        f"its {num_heads} attention heads do not divide by {ulysses_size}"
        if num_heads % ulysses_size
        else f"its {num_kv_heads} key/value heads neither divide by {ulysses_size} nor divide it (for replication)"
    )
    raise ValueError(
        f"{model_name} cannot be split over a Ulysses group of {ulysses_size} ranks (each rank attends heads / size "
        f"of the heads): {reason}. Ulysses sizes that work for {num_heads} attention / {num_kv_heads} key/value "
        f"heads: {sizes}; or use sequence_parallel_mode='ring' (any head count), or 'hybrid' with one of those as "
        "ulysses_size."
    )


def check_ring_attention_backend(backend: str) -> None:
    """Raise for an unknown backend, or for 'flash_attn' when flash-attn cannot be imported (unless a memory plan of a
    CUDA run is being traced: it needs flash-attn's allocations, not the package).

    Example:
    ```python
    >>> check_ring_attention_backend("torch")  # fine
    ```
    """
    from .kernels import is_flash_attn_available, kernels_overridden

    if backend not in RING_ATTENTION_BACKENDS:
        raise ValueError(f"ring_attn_backend must be one of {RING_ATTENTION_BACKENDS}, got {backend!r}.")
    if backend == "flash_attn" and not is_flash_attn_available() and not kernels_overridden():
        raise ImportError(
            "ring_attn_backend='flash_attn' needs the flash-attn package, which is not importable here "
            "(`pip install flash-attn --no-build-isolation` on a CUDA machine), or use ring_attn_backend='torch'."
        )


def _unwrap(model):
    # PEFT wraps the transformers model; its attention is the base model's.
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def validate_ring_attention_model(model, config: SequenceParallelConfig | None = None):
    """Raise a clear error unless the ring attention can replace `model`'s attention; returns the (unwrapped) model.

    Example:
    ```python
    >>> validate_ring_attention_model(model, SequenceParallelConfig(ring_head_stride=2))
    ```
    """
    from transformers import PreTrainedModel

    config = config or SequenceParallelConfig()
    base = _unwrap(model)
    name = type(base).__name__
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"Ring attention needs a transformers PreTrainedModel, got {name}.")
    model_config = getattr(base, "config", None)
    if model_config is None or not hasattr(model_config, "_attn_implementation"):
        raise TypeError(f"{name} has no config._attn_implementation: its attention cannot be replaced.")
    if not getattr(type(base), "_supports_attention_backend", False) or not base._can_set_attn_implementation():
        raise TypeError(
            f"{name} does not dispatch its attention through transformers' AttentionInterface "
            "(ALL_ATTENTION_FUNCTIONS), so the ring attention cannot be installed in it."
        )
    text_config = model_config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None and set(layer_types) - {"full_attention"}:
        raise NotImplementedError(
            f"{name} has attention layers of types {sorted(set(layer_types))}; the ring attention supports full "
            "causal attention only (no sliding-window, chunked or linear attention layers)."
        )
    # Models without `layer_types` (Mistral style) apply `sliding_window` to every layer when it is set.
    if (
        layer_types is None
        and getattr(text_config, "sliding_window", None)
        and getattr(text_config, "use_sliding_window", True)
    ):
        raise NotImplementedError(
            f"{name} uses sliding-window attention (sliding_window={text_config.sliding_window}); the ring attention "
            "supports full causal attention only."
        )
    if getattr(text_config, "attn_logit_softcapping", None):
        raise NotImplementedError(
            f"{name} uses attention logit softcapping ({text_config.attn_logit_softcapping}), which the ring attention "
            "does not support."
        )
    if getattr(text_config, "attention_dropout", 0.0):
        raise NotImplementedError(
            f"{name} has attention_dropout={text_config.attention_dropout}; the ring attention does not support "
            "attention dropout (set it to 0)."
        )
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"{name}: {num_heads} attention heads are not a multiple of {num_kv_heads} KV heads.")
    ulysses = ulysses_group_size(
        getattr(config, "sequence_parallel_mode", "ring"), config.sequence_parallel_size, getattr(config, "ulysses_size", None)
    )
    check_ulysses_heads(num_heads, num_kv_heads, ulysses, name)
    # After the Ulysses exchange the ring gathers this rank's share of the key/value heads.
    check_ring_head_stride(config.ring_head_stride, max(num_kv_heads // ulysses, 1), num_kv_heads, ulysses)
    check_ring_attention_backend(config.ring_attn_backend)
    return base


def validate_sequence_parallel_setup(model, config: SequenceParallelConfig, world_size: int) -> None:
    """All checks a trainer should run before training with sequence parallelism.

    Example:
    ```python
    >>> validate_sequence_parallel_setup(model, config, accelerator.num_processes)
    ```
    """
    check_sequence_parallel_size(config.sequence_parallel_size, world_size)
    validate_ring_attention_model(model, config)
