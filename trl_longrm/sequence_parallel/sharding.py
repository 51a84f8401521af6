"""Split one packed row over a ring group, and the attention metadata that goes with the slices.

A packed row (batch size 1) lays documents out contiguously, with `position_ids` restarting at 0 at each document. The
row is padded to a multiple of its number of equal chunks, its document boundaries and shifted labels are computed on
the *whole* row, and each rank receives the chunks `chunk_owners` gives it (the one definition of where a token of the
row lives): with 'balanced' (the default) 2, 4 or 8 chunks per rank go by their causal attention work to the
least-loaded rank, so that every rank has about the same work (on one document: the zigzag placement); 'zigzag' cuts
2P chunks and rank r holds chunks r and 2P-1-r; with 'contiguous' rank r holds the r-th slice. Documents cross chunk
boundaries. The attention needs the global boundaries and the pieces' places in the row: they travel in a
`RingAttentionMetadata` passed to `model(...)` as the `ring_attn_meta` keyword, never through process-global state, so
a gradient-checkpoint recompute always sees the boundaries of its own forward.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import SequenceParallelConfig
from .groups import SequenceParallelGroups


IGNORE_INDEX = -100
RING_META_KWARG = "ring_attn_meta"


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the tokens that start a document in a 1-D packed row.

    A document starts at the first token and wherever the position does not continue the previous one (in a packed
    row, where it restarts at 0).

    Example:
    ```python
    >>> document_starts(torch.tensor([0, 1, 2, 0, 1, 0]))
    tensor([ True, False, False,  True, False,  True])
    ```
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    if position_ids.numel() > 1:
        starts[1:] = position_ids[1:] != position_ids[:-1] + 1
    return starts


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> list[int]:
    """Cumulative document boundaries `[0, end_0, end_1, ..., L]` of a 1-D packed row (python ints).

    Example:
    ```python
    >>> cu_seqlens_from_position_ids(torch.tensor([0, 1, 2, 0, 1, 0]))
    [0, 3, 5, 6]
    ```
    """
    starts = torch.nonzero(document_starts(position_ids.reshape(-1))).flatten().tolist()
    return starts + [position_ids.numel()]


def span_work(cu_seqlens, prefix_lengths, start: int, end: int) -> int:
    """Causal attention work of the queries `[start, end)` of a row: each query sees its document's earlier tokens
    and itself, plus its whole shared prefix (`prefix_lengths[doc]` tokens, 0 for a document standing alone). The one
    count the placement balances and `attention_work` reports.

    Example:
    ```python
    >>> span_work((0, 3, 5), (0, 0), 0, 5)  # 1 + 2 + 3 and 1 + 2
    9
    ```
    """
    work = 0
    doc = bisect.bisect_right(cu_seqlens, start) - 1
    while start < end:
        doc_start, doc_end = cu_seqlens[doc], cu_seqlens[doc + 1]
        hi = min(end, doc_end)
        n = hi - start
        work += n * (start - doc_start + 1) + n * (n - 1) // 2 + n * prefix_lengths[doc]
        start, doc = hi, doc + 1
    return work


def prefix_lengths(cu_seqlens, segment_parents) -> list[int]:
    """Tokens each document attends to in full before its own (its shared prefix and the prefix's own), 0 without."""
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    out = []
    for doc in range(len(lengths)):
        total, parent = 0, segment_parents[doc] if segment_parents is not None else -1
        while parent != -1:
            total, parent = total + lengths[parent], segment_parents[parent]
        out.append(total)
    return out


def placement_num_chunks(placement: str, group_size: int, chunks_per_rank: int = 2) -> int:
    """How many equal chunks the padded row is cut into (the row is padded to a multiple of it): one per rank for
    'contiguous', two for 'zigzag', `chunks_per_rank` for 'balanced'."""
    if group_size == 1 or placement == "contiguous":
        return group_size
    return group_size * (2 if placement == "zigzag" else chunks_per_rank)


def chunk_owners(
    placement: str, num_chunks: int, group_size: int, cu_seqlens=None, segment_parents=None
) -> list[list[int]]:
    """For each rank, the (sorted) indices of the equal chunks of the padded row it holds.

    'contiguous': rank r holds chunk r. 'zigzag': 2P chunks, rank r holds r and 2P - 1 - r (even causal work on one
    document, as ring-flash-attention's zigzag and torch's context parallelism place it). 'balanced': the chunks go,
    heaviest causal work first (`span_work`, shared prefixes counted), to the least-loaded rank that still has room
    (every rank holds as many): on one document with 2 chunks per rank this is the zigzag placement, and it stays
    balanced where documents of different lengths share the row, which a zigzag over the whole row is not. Every
    rank computes the same owners from the row's boundaries.

    Example:
    ```python
    >>> chunk_owners("zigzag", 8, 4)
    [[0, 7], [1, 6], [2, 5], [3, 4]]
    >>> chunk_owners("balanced", 8, 4, cu_seqlens=(0, 16))  # one document: the zigzag placement
    [[0, 7], [1, 6], [2, 5], [3, 4]]
    ```
    """
    if placement == "contiguous" or group_size == 1:
        per_rank = num_chunks // group_size
        return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(group_size)]
    if placement == "zigzag":
        return [[r, num_chunks - 1 - r] for r in range(group_size)]
    if placement != "balanced":
        raise ValueError(f"Unknown ring placement {placement!r}; expected 'balanced', 'zigzag' or 'contiguous'.")
    if cu_seqlens is None:
        raise ValueError("The 'balanced' placement needs the row's document boundaries (cu_seqlens).")
    size, per_rank = cu_seqlens[-1] // num_chunks, num_chunks // group_size
    extra = prefix_lengths(cu_seqlens, segment_parents)
    works = [span_work(cu_seqlens, extra, c * size, (c + 1) * size) for c in range(num_chunks)]
    load, owners = [0] * group_size, [[] for _ in range(group_size)]
    for chunk in sorted(range(num_chunks), key=lambda c: (-works[c], c)):
        rank = min((r for r in range(group_size) if len(owners[r]) < per_rank), key=lambda r: (load[r], r))
        load[rank] += works[chunk]
        owners[rank].append(chunk)
    return [sorted(chunks) for chunks in owners]


def chunk_ranges(owned: list[int], chunk_size: int) -> list[tuple[int, int]]:
    """`(start, end)` row ranges of the sorted chunks `owned`, adjacent chunks merged into one range."""
    ranges = []
    for chunk in owned:
        start = chunk * chunk_size
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], start + chunk_size)
        else:
            ranges.append((start, start + chunk_size))
    return ranges


def split_ranges(ranges: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int]]]:
    """Cut the tokens of `ranges` (in order) into `parts` consecutive slices of equal size: the slices of a ring
    place's tokens that the ranks of its Ulysses group hold.

    Example:
    ```python
    >>> split_ranges([(0, 4), (12, 16)], 4)
    [[(0, 2)], [(2, 4)], [(12, 14)], [(14, 16)]]
    ```
    """
    total = sum(end - start for start, end in ranges)
    if total % parts:
        raise ValueError(f"{total} tokens cannot be cut into {parts} equal slices.")
    size, out, current, room = total // parts, [], [], total // parts
    for start, end in ranges:
        while start < end:
            take = min(room, end - start)
            current.append((start, start + take))
            start, room = start + take, room - take
            if room == 0:
                out.append(current)
                current, room = [], size
    return out


BALANCE_TARGET = 1.05
"""max / mean causal work over the ranks that the 'balanced' placement settles for before cutting finer chunks."""
BALANCED_CHUNKS_PER_RANK = (2, 4, 8)
"""Chunks per rank the 'balanced' placement tries, fewest first: more chunks balance rows of unequal documents
better, but each contiguous piece is one more kernel call per layer."""
MIN_BALANCED_CHUNK = 64
"""Tokens below which a chunk is not cut finer: its kernel call would cost more than the imbalance it removes."""


def balanced_chunks_per_rank(cu_seqlens, segment_parents, length: int, group_size: int) -> int:
    """Chunks per rank for the 'balanced' placement of a row of `length` tokens (documents `cu_seqlens` ending at
    `length`, before padding): the fewest of `BALANCED_CHUNKS_PER_RANK` whose placement reaches `BALANCE_TARGET`,
    else the best of them (chunks never under `MIN_BALANCED_CHUNK` tokens beyond the first choice)."""
    best = None
    for per_rank in BALANCED_CHUNKS_PER_RANK:
        num_chunks = group_size * per_rank
        if best is not None and length < num_chunks * MIN_BALANCED_CHUNK:
            break
        total = length + (-length % num_chunks)
        cu, parents = list(cu_seqlens), list(segment_parents) if segment_parents is not None else None
        if total > length:
            cu.append(total)
            parents = parents + [-1] if parents is not None else None
        extra = prefix_lengths(cu, parents)
        loads = [
            sum(span_work(cu, extra, start, end) for start, end in chunk_ranges(owned, total // num_chunks))
            for owned in chunk_owners("balanced", num_chunks, group_size, cu, parents)
        ]
        imbalance = max(loads) * group_size / max(sum(loads), 1)
        if best is None or imbalance < best[0] - 1e-9:
            best = (imbalance, per_rank)
        if imbalance <= BALANCE_TARGET:
            break
    return best[1]


def boundary_tensors(device, *boundaries) -> tuple[torch.Tensor, ...]:
    """Sequence boundaries (lists) as the int32 tensors varlen kernels take, each carrying its values on the host
    (`host_boundaries`). A kernel that plans its calls from the boundaries (`TorchCudnnOps`) reads them there: reading
    a CUDA tensor back (`.tolist()`) waits for every kernel queued before it, three times a layer. The copy to a GPU
    is issued from pinned memory without waiting for it either."""
    tensors = []
    for values in boundaries:
        tensor = torch.tensor(values, dtype=torch.int32)
        if torch.device(device).type == "cuda":
            tensor = tensor.pin_memory().to(device, non_blocking=True)
        else:
            tensor = tensor.to(device)
        tensor.host_values = tuple(values)
        tensors.append(tensor)
    return tuple(tensors)


def host_boundaries(boundaries: torch.Tensor) -> list[int]:
    """The values of a boundary tensor as a list: those it carries (`boundary_tensors`), else read from it (a tensor
    made elsewhere, e.g. by a test)."""
    values = getattr(boundaries, "host_values", None)
    return list(values) if values is not None else boundaries.tolist()


@dataclass(eq=False)
class RingAttentionMetadata:
    """What the ring attention needs to know about the row a forward pass belongs to.

    All positions are indices in the padded global row. Build it with `shard_packed_row` (or `packed_row_metadata` for
    one process) and pass it to the model as `model(..., ring_attn_meta=meta)`. A rank's tokens are one or more
    contiguous pieces of the row (`placement`); the kernels attend one piece at a time (`pieces()`), each a metadata
    of one range, for which `local_start` / `local_end` / `kv_start` are defined.

    Example:
    ```python
    >>> meta = packed_row_metadata(torch.tensor([[0, 1, 2, 0, 1]]))
    >>> meta.cu_seqlens, meta.local_start, meta.local_length
    ((0, 3, 5), 0, 5)
    ```
    """

    cu_seqlens: tuple[int, ...]
    """Document boundaries over the padded global row; the padding, if any, is its own last document."""
    total_length: int
    """Length of the padded global row (a multiple of `group_size`)."""
    unpadded_length: int
    """Length of the row before padding."""
    local_start: int
    """Index in the global row of this rank's first token."""
    local_length: int
    """Number of tokens on this rank."""
    group: dist.ProcessGroup | None = None
    """The ring group; None for a single process."""
    group_size: int = 1
    rank: int = 0
    """This process's rank in the ring group."""
    ring_head_stride: int | None = None
    """Key/value heads gathered at once; None for all of them."""
    backend: str = "auto"
    query_chunk_size: int = 1024
    segment_parents: tuple[int, ...] | None = None
    """Shared-prefix rows only: for each document (span of `cu_seqlens`), the index of the document it continues
    (its shared prefix), or -1. A document with a parent attends to the whole parent (and the parent's ancestors)
    and causally to itself; None means every document stands alone (the ordinary packed row)."""
    placement: str = "contiguous"
    """How the row is placed over the ring (`chunk_owners`): 'contiguous' (one range per rank: `local_start`,
    `local_length`), 'zigzag' (two ranges per rank) or 'balanced' (chunks assigned by their causal work)."""
    num_chunks: int | None = None
    """Equal chunks the row is cut into for the placement; None for the placement's default
    (`placement_num_chunks` with two chunks per rank)."""
    is_piece: bool = False
    """A single range of a rank's tokens, as the kernels receive it (`pieces()`): its `local_length` is the piece's."""
    ulysses_size: int = 1
    """Ranks of a Ulysses group ('ulysses' and 'hybrid' modes): the row is placed over `group_size / ulysses_size`
    ring places (`placement`, `num_chunks`), and the tokens of each place are cut into `ulysses_size` consecutive
    slices, one per rank of the Ulysses group; the attention all-to-alls heads within it (`attention_view`)."""
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    """The ranks that run the ring attention together after the Ulysses exchange (None: no ring)."""
    _cache: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        self.cu_seqlens = tuple(int(x) for x in self.cu_seqlens)
        if self.cu_seqlens[0] != 0 or self.cu_seqlens[-1] != self.total_length:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at total_length={self.total_length}, got {self.cu_seqlens}."
            )
        if not self.is_piece and self.total_length != self.local_length * self.group_size:
            raise ValueError(
                f"total_length={self.total_length} is not group_size={self.group_size} x "
                f"local_length={self.local_length}: the row must be padded to a multiple of the ring size."
            )
        if self.group_size % self.ulysses_size:
            raise ValueError(f"ulysses_size={self.ulysses_size} does not divide group_size={self.group_size}.")
        if self.num_chunks is None:
            self.num_chunks = placement_num_chunks(self.placement, self.ring_size)
        if not self.is_piece and (
            self.num_chunks % self.ring_size or self.total_length % (self.num_chunks * self.ulysses_size)
        ):
            raise ValueError(
                f"total_length={self.total_length} must be a multiple of num_chunks={self.num_chunks} x "
                f"ulysses_size={self.ulysses_size}, num_chunks being a multiple of the ring's {self.ring_size} places, "
                f"for the {self.placement!r} placement."
            )
        if self.segment_parents is not None:
            self.segment_parents = tuple(int(x) for x in self.segment_parents)
            if len(self.segment_parents) != len(self.cu_seqlens) - 1:
                raise ValueError(
                    f"segment_parents has {len(self.segment_parents)} entries for {len(self.cu_seqlens) - 1} documents."
                )
            for index, parent in enumerate(self.segment_parents):
                if not -1 <= parent < index:
                    raise ValueError(
                        f"segment_parents[{index}] = {parent}: a document's prefix must be an earlier document or -1."
                    )
            if all(parent == -1 for parent in self.segment_parents):
                self.segment_parents = None

    @property
    def ring_size(self) -> int:
        """Places of the ring the row is placed over: `group_size / ulysses_size`."""
        return self.group_size // self.ulysses_size

    def attention_view(self) -> RingAttentionMetadata:
        """The metadata the attention runs on after the Ulysses exchange: this rank's Ulysses group's tokens (its
        ring place's, the group's slices in order) over the ring of places. Itself when there is no Ulysses group;
        with no ring (`ulysses` mode) the whole row on one place, attended locally."""
        if self.ulysses_size == 1:
            return self
        if "view" not in self._cache:
            place = self.rank // self.ulysses_size
            self._cache["view"] = dataclasses.replace(
                self,
                local_start=self.local_ranges(place * self.ulysses_size)[0][0],  # the place's first slice's start
                local_length=self.total_length // self.ring_size,
                group=self.ring_group if self.ring_size > 1 else None,
                group_size=self.ring_size,
                rank=place,
                ulysses_size=1,
                ulysses_group=None,
            )
        return self._cache["view"]

    @property
    def has_shared_prefixes(self) -> bool:
        """Whether some document continues a shared prefix (its responses attend to it: no plain varlen layout)."""
        return self.segment_parents is not None

    def ancestors(self, document: int) -> list[int]:
        """Documents that `document` attends to in full, earliest first (its prefix, the prefix's prefix, ...)."""
        chain = []
        parent = self.segment_parents[document] if self.segment_parents is not None else -1
        while parent != -1:
            chain.append(parent)
            parent = self.segment_parents[parent]
        return chain[::-1]

    @property
    def local_end(self) -> int:
        return self.local_start + self.local_length

    def local_ranges(self, rank: int | None = None) -> list[tuple[int, int]]:
        """The global `(start, end)` ranges held by `rank` (default: this rank), in local order."""
        if self.is_piece:
            return [(self.local_start, self.local_end)]
        if "owners" not in self._cache:
            self._cache["owners"] = chunk_owners(
                self.placement, self.num_chunks, self.ring_size, self.cu_seqlens, self.segment_parents
            )
        rank = self.rank if rank is None else rank
        ranges = chunk_ranges(self._cache["owners"][rank // self.ulysses_size], self.total_length // self.num_chunks)
        if self.ulysses_size == 1:
            return ranges
        return split_ranges(ranges, self.ulysses_size)[rank % self.ulysses_size]

    def pieces(self) -> list[tuple[int, RingAttentionMetadata]]:
        """`(offset in the local tokens, metadata of that one range)` for each contiguous piece of this rank's tokens:
        what a kernel attends at a time. A contiguous placement has one piece, this metadata itself."""
        if "pieces" not in self._cache:
            ranges = self.local_ranges()
            if len(ranges) == 1 and ranges[0] == (self.local_start, self.local_end):
                # Itself, not cached: `[(0, self)]` in its own cache would be a reference cycle, which keeps the
                # metadata and the tensors it caches (index orders of the whole row) alive past its step, until
                # Python's cyclic GC happens to run.
                self._cache["pieces"] = None
            else:
                pieces, offset = [], 0
                for start, end in ranges:
                    piece = dataclasses.replace(self, local_start=start, local_length=end - start, is_piece=True)
                    pieces.append((offset, piece))
                    offset += end - start
                self._cache["pieces"] = pieces
        return self._cache["pieces"] or [(0, self)]

    def global_index(self, device: torch.device | str = "cpu", rank: int | None = None) -> torch.Tensor:
        """Global positions of the local tokens of `rank` (default: this rank), in local order."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.local_ranges(rank)])

    def local_positions(self, global_positions: torch.Tensor) -> torch.Tensor:
        """Local index of each global position on this rank, -1 where another rank holds it."""
        local = torch.full_like(global_positions, -1)
        offset = 0
        for start, end in self.local_ranges():
            inside = (global_positions >= start) & (global_positions < end)
            local = torch.where(inside, global_positions - start + offset, local)
            offset += end - start
        return local

    def rank_major_order(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of the tokens of an all-gather (rank 0's local tokens, then rank 1's, ...): `gathered`
        holds the row as `row[order] = gathered`, and a row goes back to the ranks as `row[order]`."""
        key = ("rank_major", str(device))
        if key not in self._cache:
            self._cache[key] = torch.cat([self.global_index(device, rank) for rank in range(self.group_size)])
        return self._cache[key]

    def key_span(self) -> tuple[int, int]:
        """`(start, end)` of the global row holding every key the local queries see (all pieces')."""
        pieces = [piece for _, piece in self.pieces()]
        return min(piece.kv_start for piece in pieces), max(piece.local_end for piece in pieces)

    def to_global_order(self, gathered: torch.Tensor, dim: int = 0, span: tuple[int, int] | None = None):
        """A rank-major all-gather of per-token values (along `dim`) in the row's order, optionally only the global
        positions `[start, end)` of `span`."""
        start, end = span if span is not None else (0, self.total_length)
        if self.placement == "contiguous" or self.group_size == 1:
            return gathered.narrow(dim, start, end - start)
        return gathered.index_select(dim, self._rank_major_index(gathered.device)[start:end])

    def _rank_major_index(self, device: torch.device | str) -> torch.Tensor:
        """Position in the rank-major order of each global position (the inverse of `rank_major_order`)."""
        key = ("inverse", str(device))
        if key not in self._cache:
            self._cache[key] = torch.argsort(self.rank_major_order(device))
        return self._cache[key]

    def to_rank_major_order(self, row: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Per-token values of the whole row (along `dim`) in the order a reduce-scatter hands them to the ranks."""
        if self.placement == "contiguous" or self.group_size == 1:
            return row
        return row.index_select(dim, self.rank_major_order(row.device))

    def span_in_rank_major_order(self, values: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
        """`to_rank_major_order` of a whole row that is zero but for `values` (along dim 0) at the global positions
        `[start, end)` of `span`, written straight into the rank-major order: one row-sized buffer, not a row in the
        row's order and its reordered copy (each 2 GiB of float32 key/value gradients at 2M tokens)."""
        start, end = span
        out = values.new_zeros((self.total_length, *values.shape[1:]))
        if self.placement == "contiguous" or self.group_size == 1:
            out[start:end] = values
        else:
            out.index_copy_(0, self._rank_major_index(values.device)[start:end], values)
        return out

    def local_documents(self) -> range:
        """Indices of the documents that have tokens on this rank."""
        first = bisect.bisect_right(self.cu_seqlens, self.local_start) - 1
        last = bisect.bisect_left(self.cu_seqlens, self.local_end) - 1
        return range(first, last + 1)

    @property
    def kv_start(self) -> int:
        """Start of the document holding this rank's first token (or of the earliest shared prefix that a local
        document continues): no local query looks at keys before it."""
        if "kv_start" not in self._cache:
            documents = self.local_documents()
            start = self.cu_seqlens[documents[0]]
            if self.segment_parents is not None:
                for doc in documents:
                    ancestors = self.ancestors(doc)
                    if ancestors:
                        start = min(start, self.cu_seqlens[ancestors[0]])
            self._cache["kv_start"] = start
        return self._cache["kv_start"]

    @property
    def num_padding(self) -> int:
        return self.total_length - self.unpadded_length

    def document_spans(self, include_padding: bool = False) -> list[tuple[int, int]]:
        """`(start, end)` of every document in the global row; the padding document is left out by default."""
        spans = list(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))
        if not include_padding and self.num_padding:
            spans = spans[:-1]
        return spans

    def document_last_token_indices(self) -> list[int]:
        """Global index of the last token of every (non-padding) document: where a sequence score is read."""
        return [end - 1 for _, end in self.document_spans()]

    def key_document_ids(self, device: torch.device) -> torch.Tensor:
        """Document index of every global position in `[kv_start, local_end)` (the keys local queries can see)."""
        key = ("doc_ids", str(device))
        if key not in self._cache:
            lengths = torch.tensor(self.cu_seqlens[1:]) - torch.tensor(self.cu_seqlens[:-1])
            ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
            self._cache[key] = ids[self.kv_start : self.local_end].to(device)
        return self._cache[key]

    def varlen_layout(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """`(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)` for a varlen kernel with bottom-right causal
        alignment: the local queries of each document against the keys `[document start, last local query]`, the
        keys being the global row's `[kv_start, local_end)`."""
        if self.segment_parents is not None:
            raise NotImplementedError(
                "A row with shared prefixes has no single varlen layout (see kernels.SharedPrefixVarlenKernel)."
            )
        key = ("varlen", str(device))
        if key not in self._cache:
            cu_q, cu_k, max_q, max_k = [0], [0], 0, 0
            first = bisect.bisect_right(self.cu_seqlens, self.local_start) - 1
            for doc in range(first, len(self.cu_seqlens) - 1):
                doc_start, doc_end = self.cu_seqlens[doc], self.cu_seqlens[doc + 1]
                if doc_start >= self.local_end:
                    break
                q_lo, q_hi = max(doc_start, self.local_start), min(doc_end, self.local_end)
                cu_q.append(cu_q[-1] + q_hi - q_lo)
                cu_k.append(cu_k[-1] + q_hi - doc_start)
                max_q, max_k = max(max_q, q_hi - q_lo), max(max_k, q_hi - doc_start)
            self._cache[key] = (*boundary_tensors(device, cu_q, cu_k), max_q, max_k)
        return self._cache[key]


def attention_work(meta: RingAttentionMetadata) -> int:
    """(query, key) pairs this rank's queries attend: each local query sees its document's earlier tokens and itself,
    plus the whole of its shared prefixes. What the ring's placement should spread evenly over the ranks.

    Example:
    ```python
    >>> attention_work(packed_row_metadata(torch.tensor([0, 1, 2, 0, 1])))  # 1 + 2 + 3 and 1 + 2
    9
    ```
    """
    extra = prefix_lengths(meta.cu_seqlens, meta.segment_parents)
    return sum(span_work(meta.cu_seqlens, extra, start, end) for start, end in meta.local_ranges())


def _segment_boundaries(segment_lengths, length: int, source: str) -> list[int]:
    lengths = [int(n) for n in torch.as_tensor(segment_lengths).reshape(-1).tolist()]
    if any(n <= 0 for n in lengths) or sum(lengths) != length:
        raise ValueError(
            f"{source}: `segment_lengths` {lengths} must be positive and sum to the row's {length} tokens."
        )
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def shared_row_metadata(
    segment_lengths: torch.Tensor, segment_parents: torch.Tensor, config: SequenceParallelConfig | None = None
) -> RingAttentionMetadata:
    """Metadata of a whole shared-prefix row on one process (no ring), from the collator's `segment_lengths` and
    `segment_parents` (see `trl_longrm.packing`). A shared row's documents cannot be read from its `position_ids`
    (a response continues its prefix's positions), so the model must receive this metadata.

    Example:
    ```python
    >>> meta = shared_row_metadata(torch.tensor([3, 2, 2]), torch.tensor([-1, 0, 0]))
    >>> meta.cu_seqlens, meta.segment_parents
    ((0, 3, 5, 7), (-1, 0, 0))
    ```
    """
    config = config or SequenceParallelConfig()
    length = int(torch.as_tensor(segment_lengths).sum())
    return RingAttentionMetadata(
        cu_seqlens=tuple(_segment_boundaries(segment_lengths, length, "shared row")),
        total_length=length,
        unpadded_length=length,
        local_start=0,
        local_length=length,
        ring_head_stride=config.ring_head_stride,
        backend=config.ring_attn_backend,
        query_chunk_size=config.ring_query_chunk_size,
        segment_parents=tuple(int(p) for p in torch.as_tensor(segment_parents).reshape(-1).tolist()),
    )


def packed_row_metadata(
    position_ids: torch.Tensor, config: SequenceParallelConfig | None = None
) -> RingAttentionMetadata:
    """Metadata of a whole packed row on one process (no ring), from its `position_ids` (`[L]` or `[1, L]`).

    Passing it to the model spares the attention from recomputing the boundaries in every layer.

    Example:
    ```python
    >>> meta = packed_row_metadata(torch.tensor([[0, 1, 0, 1, 2]]))
    >>> logits = model(input_ids=ids, position_ids=pos, use_cache=False, ring_attn_meta=meta).logits
    ```
    """
    config = config or SequenceParallelConfig()
    length = position_ids.numel()
    return RingAttentionMetadata(
        cu_seqlens=tuple(cu_seqlens_from_position_ids(position_ids)),
        total_length=length,
        unpadded_length=length,
        local_start=0,
        local_length=length,
        ring_head_stride=config.ring_head_stride,
        backend=config.ring_attn_backend,
        query_chunk_size=config.ring_query_chunk_size,
    )


@dataclass
class ShardedRow:
    """This rank's slice of a packed row. All tensors have batch size 1 and `local_length` tokens.

    Example:
    ```python
    >>> shard = shard_packed_row(input_ids, position_ids, labels, groups=groups, pad_token_id=tok.pad_token_id)
    >>> logits = model(**shard.model_inputs()).logits  # [1, local_length, vocab]
    ```
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    """Label of each token = the next token of the same document, -100 at document ends, padding and no-loss tokens.
    Already shifted: compare `logits[:, t]` with `shift_labels[:, t]`."""
    document_ids: torch.Tensor
    """Index of each token's document in the global row; -1 on padding."""
    extras: dict[str, torch.Tensor]
    """The other per-token tensors, padded with zeros and sliced like `input_ids` (not shifted)."""
    attention_meta: RingAttentionMetadata

    def model_inputs(self) -> dict:
        """Keyword arguments for `model(...)`: ids, positions, the metadata, and `use_cache=False` (needed for packed
        rows to stay document-separated)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            RING_META_KWARG: self.attention_meta,
            "use_cache": False,
        }


def _as_row(tensor: torch.Tensor, name: str, source: str, length: int | None = None) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{source}: `{name}` must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dim() >= 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    elif tensor.dim() >= 2:
        raise ValueError(
            f"{source}: `{name}` has batch size {tensor.shape[0]}; sequence parallelism takes one packed row "
            f"(batch size 1, shape [1, L])."
        )
    if tensor.dim() == 0:
        raise ValueError(f"{source}: `{name}` must have a token dimension, got a scalar.")
    if length is not None and tensor.shape[0] != length:
        raise ValueError(f"{source}: `{name}` has {tensor.shape[0]} tokens but `input_ids` has {length}.")
    return tensor


def _pad(tensor: torch.Tensor, amount: int, value) -> torch.Tensor:
    if amount == 0:
        return tensor
    padding = torch.full((amount, *tensor.shape[1:]), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, padding])


def shifted_labels(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels of a 1-D packed row: `out[t] = labels[t + 1]` when `t + 1` is in the same document, else -100.

    Example:
    ```python
    >>> shifted_labels(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 1, 2, 0, 1]))
    tensor([   6,    7, -100,    9, -100])
    ```
    """
    starts = document_starts(position_ids)
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:-1] = torch.where(starts[1:], torch.full_like(labels[1:], IGNORE_INDEX), labels[1:])
    return out


def _verify_same_row(input_ids: torch.Tensor, group: dist.ProcessGroup, source: str) -> None:
    # Every rank of a ring must slice the *same* row; a sampler sharding over the world instead of the data-parallel
    # group would silently give each rank a different one.
    from .collectives import collective_device

    weights = torch.arange(input_ids.numel(), device=input_ids.device) % 65521 + 1
    fingerprint = torch.stack([torch.tensor(input_ids.numel()), (input_ids.long() * weights).sum().cpu()])
    fingerprint = fingerprint.to(collective_device(group))
    gathered = [torch.empty_like(fingerprint) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, fingerprint, group=group)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        lengths = [int(g[0]) for g in gathered]
        raise RuntimeError(
            f"{source}: the ranks of one sequence-parallel ring hold different rows (lengths {lengths}). All ranks of "
            "a ring must receive the same packed row: shard the data over the data-parallel group "
            "(SequenceParallelGroups.data_parallel_rank / data_parallel_size), not over the world."
        )


def shard_packed_row(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    *,
    loss_mask: torch.Tensor | None = None,
    extras: dict[str, torch.Tensor] | None = None,
    groups: SequenceParallelGroups | None = None,
    config: SequenceParallelConfig | None = None,
    pad_token_id: int = 0,
    verify_same_row: bool = True,
    source: str = "packed row",
    segment_lengths: torch.Tensor | None = None,
    segment_parents: torch.Tensor | None = None,
) -> ShardedRow:
    """Pad a packed row to a multiple of its placement's chunk count (`placement_num_chunks`), compute its global
    boundaries and shifted labels, and return this rank's tokens (by `config.ring_placement`, `chunk_owners`) with
    the attention metadata.

    Args:
        input_ids: `[1, L]` (or `[L]`) token ids of one packed row.
        position_ids: `[1, L]` positions restarting at 0 at each document; None means one document.
        labels: per-token (unshifted) labels, -100 where no loss; defaults to `input_ids` (loss everywhere).
        loss_mask: alternative to `labels`: 1 where a token is a prediction target (labels = input_ids there).
        extras: other per-token tensors (`[1, L, ...]`), padded with zeros and sliced.
        groups: the ring; None (or a size-1 ring) keeps the whole row on this process.
        config: ring placement, head stride, kernel backend and query chunk size carried by the metadata.
        pad_token_id: id of the padding tokens (they form their own document, with no loss).
        verify_same_row: check with one tiny collective that all ranks of the ring hold the same row.
        source: name of the data in error messages.
        segment_lengths, segment_parents: the documents of a shared-prefix row and the prefix each continues (-1:
            none), as the collator emits them; they replace the boundaries read from `position_ids`, and a label is
            shifted within its own document only.

    Example:
    ```python
    >>> shard = shard_packed_row(batch["input_ids"], batch["position_ids"], batch["labels"], groups=groups)
    >>> out = model(**shard.model_inputs())
    ```
    """
    config = config or SequenceParallelConfig()
    ids = _as_row(input_ids, "input_ids", source)
    length = ids.shape[0]
    if length == 0:
        raise ValueError(f"{source}: the packed row is empty.")
    if position_ids is None:
        pos = torch.arange(length, device=ids.device)
    else:
        pos = _as_row(position_ids, "position_ids", source, length)
        if (pos < 0).any():
            raise ValueError(f"{source}: `position_ids` has negative entries.")
    if labels is not None and loss_mask is not None:
        raise ValueError(f"{source}: give either `labels` or `loss_mask`, not both.")
    if loss_mask is not None:
        mask = _as_row(loss_mask, "loss_mask", source, length).bool()
        lab = torch.where(mask, ids, torch.full_like(ids, IGNORE_INDEX))
    elif labels is not None:
        lab = _as_row(labels, "labels", source, length)
    else:
        lab = ids
    extras = {name: _as_row(value, f"extras[{name!r}]", source, length) for name, value in (extras or {}).items()}

    group = groups.ring_group if groups is not None and groups.enabled else None
    size = groups.sequence_parallel_size if group is not None else 1
    rank = groups.ring_rank if group is not None else 0
    ulysses = getattr(groups, "ulysses_size", 1) if group is not None else 1
    if group is not None and verify_same_row:
        _verify_same_row(ids, group, source)

    # The row is placed over the ring's places; a Ulysses group (which attends its tokens together) is one place.
    places = size // ulysses
    placement = config.ring_placement if places > 1 else "contiguous"
    if segment_lengths is not None:
        if segment_parents is None:
            raise ValueError(f"{source}: `segment_lengths` needs `segment_parents`.")
        cu_seqlens = _segment_boundaries(segment_lengths, length, source)
        parents = [int(p) for p in torch.as_tensor(segment_parents).reshape(-1).tolist()]
    else:
        cu_seqlens, parents = cu_seqlens_from_position_ids(pos), None
    chunks_per_rank = 2
    if placement == "balanced":
        chunks_per_rank = balanced_chunks_per_rank(cu_seqlens, parents, length, places)
    num_chunks = placement_num_chunks(placement, places, chunks_per_rank)
    num_padding = -length % (num_chunks * ulysses)
    total = length + num_padding
    # The padding is a document of its own (positions 0, 1, ...), so no real token attends to it.
    ids_p = _pad(ids, num_padding, pad_token_id)
    pos_p = torch.cat([pos, torch.arange(num_padding, dtype=pos.dtype, device=pos.device)])
    lab_p = _pad(lab, num_padding, IGNORE_INDEX)
    if num_padding:
        cu_seqlens.append(total)
        parents = parents + [-1] if parents is not None else None
    starts = torch.zeros(total, dtype=torch.bool, device=ids.device)
    starts[cu_seqlens[:-1]] = True
    shift = torch.full_like(lab_p, IGNORE_INDEX)
    shift[:-1] = torch.where(starts[1:], torch.full_like(lab_p[1:], IGNORE_INDEX), lab_p[1:])
    doc_ids = torch.cumsum(starts.long(), 0) - 1
    if num_padding:
        doc_ids[length:] = -1

    meta = RingAttentionMetadata(
        cu_seqlens=tuple(cu_seqlens),
        total_length=total,
        unpadded_length=length,
        local_start=0,  # set below, from the placement
        local_length=total // size,
        group=group,
        group_size=size,
        rank=rank,
        ring_head_stride=config.ring_head_stride,
        backend=config.ring_attn_backend,
        query_chunk_size=config.ring_query_chunk_size,
        segment_parents=parents,
        placement=placement,
        num_chunks=num_chunks,
        ulysses_size=ulysses,
        ulysses_group=getattr(groups, "ulysses_group", None) if group is not None else None,
        ring_group=getattr(groups, "ring_attention_group", group) if group is not None else None,
    )
    meta.local_start = meta.local_ranges()[0][0]
    index = meta.global_index(ids.device)
    return ShardedRow(
        input_ids=ids_p[index].unsqueeze(0),
        position_ids=pos_p[index].unsqueeze(0),
        shift_labels=shift[index].unsqueeze(0),
        document_ids=doc_ids[index].unsqueeze(0),
        extras={name: _pad(value, num_padding, 0)[index].unsqueeze(0) for name, value in extras.items()},
        attention_meta=meta,
    )
