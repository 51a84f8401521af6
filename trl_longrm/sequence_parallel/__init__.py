"""Sequence parallelism for long packed rows: a ring group of processes shares one row, attention stays exact.

Typical use in a trainer:
```python
>>> from trl_longrm.sequence_parallel import (
...     SequenceParallelConfig, apply_ring_attention, gather_sequence, init_sequence_parallel_groups, shard_packed_row,
... )
>>> config = SequenceParallelConfig(sequence_parallel_size=2)
>>> groups = init_sequence_parallel_groups(config.sequence_parallel_size)  # after init_process_group
>>> model = apply_ring_attention(model, config)
>>> shard = shard_packed_row(batch["input_ids"], batch["position_ids"], batch["labels"], groups=groups, config=config)
>>> logits = model(**shard.model_inputs()).logits  # this rank's slice
>>> logps = torch.log_softmax(logits, -1).gather(-1, shard.shift_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
>>> logps = gather_sequence(logps, shard.attention_meta)  # whole row, autograd-aware; same loss on every rank
```
"""

from .attention import RING_ATTENTION_NAME, apply_ring_attention, register_ring_attention, ring_attention_forward
from .collectives import all_gather_autograd, gather_sequence
from .config import RING_ATTENTION_BACKENDS, SequenceParallelConfig
from .groups import (
    SequenceParallelGroups,
    check_rings_within_nodes,
    check_sequence_parallel_size,
    init_sequence_parallel_groups,
)
from .kernels import is_flash_attn_available
from .sharding import (
    IGNORE_INDEX,
    RING_META_KWARG,
    RingAttentionMetadata,
    ShardedRow,
    cu_seqlens_from_position_ids,
    document_starts,
    packed_row_metadata,
    shard_packed_row,
    shifted_labels,
)
from .validation import (
    check_ring_attention_backend,
    check_ring_head_stride,
    validate_ring_attention_model,
    validate_sequence_parallel_setup,
)


__all__ = [
    "IGNORE_INDEX",
    "RING_ATTENTION_BACKENDS",
    "RING_ATTENTION_NAME",
    "RING_META_KWARG",
    "RingAttentionMetadata",
    "SequenceParallelConfig",
    "SequenceParallelGroups",
    "ShardedRow",
    "all_gather_autograd",
    "apply_ring_attention",
    "check_ring_attention_backend",
    "check_ring_head_stride",
    "check_rings_within_nodes",
    "check_sequence_parallel_size",
    "cu_seqlens_from_position_ids",
    "document_starts",
    "gather_sequence",
    "init_sequence_parallel_groups",
    "is_flash_attn_available",
    "packed_row_metadata",
    "register_ring_attention",
    "ring_attention_forward",
    "shard_packed_row",
    "shifted_labels",
    "validate_ring_attention_model",
    "validate_sequence_parallel_setup",
]
