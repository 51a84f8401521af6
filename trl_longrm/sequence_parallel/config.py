"""Configuration of sequence parallelism (ring attention) for long packed rows."""

from __future__ import annotations

from dataclasses import dataclass, field


RING_ATTENTION_BACKENDS = ("auto", "torch", "cudnn", "flash_attn")
RING_PLACEMENTS = ("balanced", "zigzag", "contiguous")
SEQUENCE_PARALLEL_MODES = ("ring", "ulysses", "hybrid")


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
    sequence_parallel_mode: str | None = field(
        default=None,
        metadata={
            "help": "How the processes of a sequence-parallel group share a row's attention. 'ring' (default): each "
            "rank keeps its queries and gathers every rank's keys/values (in head chunks): it receives the whole row's "
            "keys/values per layer whatever the group size, and works with any head count. 'ulysses' (DeepSpeed "
            "Ulysses): q, k, v and the output are exchanged by all-to-all over heads, each rank then attends the whole "
            "row for heads / size of the heads: it receives ~4/size of its slice's q/k/v/out per layer, but the query "
            "heads must divide by the group size (key/value heads divide it or are replicated). 'hybrid' (USP): "
            "Ulysses inside groups of `ulysses_size` consecutive ranks (one machine) and the ring across them. Unset: "
            "'ring', or 'ulysses' when accelerate's `parallelism_config` asks for sp_size (DeepSpeed's Ulysses)."
        },
    )
    ulysses_size: int | None = field(
        default=None,
        metadata={
            "help": "With sequence_parallel_mode='hybrid': the ranks of one Ulysses (all-to-all over heads) group, "
            "consecutive ranks on one machine; sequence_parallel_size / ulysses_size groups then form the ring. "
            "A divisor of sequence_parallel_size; left unset (or 1) for 'ring', unset (or the group size) for "
            "'ulysses'."
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
            "available), 'cudnn' (CUDA: cuDNN's fused attention through torch for sequences of 2048+ queries, torch's "
            "varlen kernels for the rest), 'flash_attn' (flash-attn varlen kernels, CUDA, needs the flash-attn "
            "package) or 'auto' (on CUDA half-precision tensors: cudnn on Hopper and newer GPUs, where it is the fastest; "
            "before Hopper flash_attn when importable, else cudnn; torch elsewhere; the choice is logged). Default: "
            "'auto'."
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
        if hasattr(self, "parallelism_config"):  # a trainer config: accelerate's sp_size is read as ours
            from .accelerate_parallelism import absorb_accelerate_parallelism

            absorb_accelerate_parallelism(self)
        if self.sequence_parallel_mode is None:
            self.sequence_parallel_mode = "ring"
        check_sequence_parallel_mode(self.sequence_parallel_mode, self.sequence_parallel_size, self.ulysses_size)
        if self.ring_placement not in RING_PLACEMENTS:
            raise ValueError(f"ring_placement must be one of {RING_PLACEMENTS}, got {self.ring_placement!r}.")
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


def check_sequence_parallel_mode(mode: str, sequence_parallel_size, ulysses_size) -> None:
    """Raise unless the mode, the group size and `ulysses_size` go together.

    Example:
    ```python
    >>> check_sequence_parallel_mode("hybrid", 4, 2)  # Ulysses pairs, a ring of 2 pairs
    >>> check_sequence_parallel_mode("hybrid", 4, 3)  # raises ValueError
    ```
    """
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be a positive integer, got {sequence_parallel_size!r}.")
    if mode not in SEQUENCE_PARALLEL_MODES:
        raise ValueError(f"sequence_parallel_mode must be one of {SEQUENCE_PARALLEL_MODES}, got {mode!r}.")
    if ulysses_size is not None and (not isinstance(ulysses_size, int) or ulysses_size < 1):
        raise ValueError(f"ulysses_size must be a positive integer or None, got {ulysses_size!r}.")
    if mode == "ring" and ulysses_size not in (None, 1):
        raise ValueError(
            f"ulysses_size={ulysses_size} is set but sequence_parallel_mode='ring' does not use it; set "
            "sequence_parallel_mode='hybrid' (Ulysses groups of ulysses_size inside a ring) or unset ulysses_size."
        )
    if mode == "ulysses" and ulysses_size not in (None, sequence_parallel_size):
        raise ValueError(
            f"sequence_parallel_mode='ulysses' exchanges heads over the whole group of sequence_parallel_size="
            f"{sequence_parallel_size} ranks, but ulysses_size={ulysses_size}; unset it, or use "
            "sequence_parallel_mode='hybrid' for Ulysses groups inside a ring."
        )
    if mode == "hybrid":
        divisors = [d for d in range(2, sequence_parallel_size) if sequence_parallel_size % d == 0]
        if ulysses_size is None or ulysses_size not in divisors:
            raise ValueError(
                f"sequence_parallel_mode='hybrid' needs ulysses_size, a divisor of sequence_parallel_size="
                f"{sequence_parallel_size} between 2 and {sequence_parallel_size - 1} (the ring then has "
                f"sequence_parallel_size / ulysses_size groups), got {ulysses_size!r}; possible values: {divisors}."
            )


def ulysses_group_size(mode: str, sequence_parallel_size: int, ulysses_size: int | None) -> int:
    """Ranks of one Ulysses (all-to-all over heads) group: 1 for 'ring', the whole group for 'ulysses'."""
    if mode == "ring" or sequence_parallel_size == 1:
        return 1
    return sequence_parallel_size if mode == "ulysses" else ulysses_size
