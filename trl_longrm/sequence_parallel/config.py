"""Configuration of sequence parallelism (ring attention) for long packed rows."""

from __future__ import annotations

from dataclasses import dataclass, field


RING_ATTENTION_BACKENDS = ("auto", "torch", "flash_attn")
RING_PLACEMENTS = ("balanced", "zigzag", "contiguous")


@dataclass
class SequenceParallelConfig:
    """Settings of sequence parallelism: one packed row is split over a ring group of processes.

    The fields can be embedded in a trainer config (dataclass inheritance) or kept as a separate object.

    Example:
    ```python
    >>> from trl_longrm.sequence_parallel import SequenceParallelConfig
    >>> config = SequenceParallelConfig(sequence_parallel_size=4, ring_head_stride=1)
    >>> config.sequence_parallel_size
    4
    ```
    """

    sequence_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Number of processes one packed row is split over (the ring group). Contiguous ranks form a ring; "
            "it must divide the world size, and world_size / sequence_parallel_size is the data-parallel size. "
            "1 (default) disables sequence parallelism."
        },
    )
    ring_head_stride: int | None = field(
        default=1,
        metadata={
            "help": "Number of key/value heads whose keys and values are gathered from the whole ring at once. Smaller "
            "values bound the peak memory (one gathered chunk is ring_length x stride x head_dim x 2) at the cost of "
            "more collectives. Must divide the model's number of key/value heads. None gathers all heads at once. "
            "Default: 1."
        },
    )
    ring_attn_backend: str = field(
        default="auto",
        metadata={
            "help": "Attention kernel: 'torch' (pure PyTorch, any device; varlen flash kernels of torch on CUDA when "
            "available), 'flash_attn' (flash-attn varlen kernels, CUDA, needs the flash-attn package) or 'auto' "
            "(flash_attn when importable and the tensors are on CUDA, else torch). Default: 'auto'."
        },
    )
    ring_query_chunk_size: int = field(
        default=1024,
        metadata={
            "help": "Number of queries per block in the pure PyTorch kernel, so that the attention mask and scores of "
            "only query_chunk x key_span entries exist at once. Default: 1024."
        },
    )

    ring_placement: str = field(
        default="balanced",
        metadata={
            "help": "How a row's tokens are placed over the ring, so that every rank does the same causal attention "
            "work: 'balanced' (default: the row is cut into 2, 4 or 8 chunks per rank, the fewest whose max/mean "
            "work per rank is at most 1.05, the chunks going by their attention work to the least-loaded rank; on one document this is "
            "the zigzag placement, and it stays balanced on packed rows of documents of different lengths and on "
            "shared-prefix rows), 'zigzag' (2 x ring size chunks, rank r holds chunks r and 2 x size - 1 - r, as "
            "ring-flash-attention's zigzag and torch's context parallelism place one document) or 'contiguous' (rank "
            "r holds the r-th slice; the last rank then does (2P - 1) / P of the mean work on one long document)."
        },
    )

    def __post_init__(self):
        if self.ring_placement not in RING_PLACEMENTS:
            raise ValueError(f"ring_placement must be one of {RING_PLACEMENTS}, got {self.ring_placement!r}.")
        if not isinstance(self.sequence_parallel_size, int) or self.sequence_parallel_size < 1:
            raise ValueError(
                f"sequence_parallel_size must be a positive integer, got {self.sequence_parallel_size!r}."
            )
        if self.ring_head_stride is not None and (
            not isinstance(self.ring_head_stride, int) or self.ring_head_stride < 1
        ):
            raise ValueError(f"ring_head_stride must be a positive integer or None, got {self.ring_head_stride!r}.")
        if self.ring_attn_backend not in RING_ATTENTION_BACKENDS:
            raise ValueError(
                f"ring_attn_backend must be one of {RING_ATTENTION_BACKENDS}, got {self.ring_attn_backend!r}."
            )
        if not isinstance(self.ring_query_chunk_size, int) or self.ring_query_chunk_size < 1:
            raise ValueError(f"ring_query_chunk_size must be a positive integer, got {self.ring_query_chunk_size!r}.")
