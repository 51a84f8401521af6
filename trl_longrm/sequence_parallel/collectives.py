"""Autograd-aware collectives over the ring group.

`all_gather_autograd` concatenates the ranks' tensors; its backward *sums* the gradient contributions of every rank and
returns each rank the part for its own tensor (a reduce-scatter). Gradient convention that follows: when every rank of
a ring computes the same loss from gathered values, each rank's parameter gradient is `group_size` x its own share, so
the *average* of the parameter gradients over the ring (what DDP / DeepSpeed all-reduce does over the world) is exactly
the gradient of the loss; equivalently, their sum is `group_size` x that gradient.

`torch.distributed.nn.functional.all_gather` has the same backward but is deprecated in torch 2.13 and emulates the
reduce-scatter with scatters on gloo; the functional collectives' autograd differs across torch versions. The small
Function below uses the stable tensor collectives on any backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# torch 2.13 renames the single-tensor collectives (the old names warn); older versions only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device tensors must be on for a collective in `group` (CUDA for NCCL, else CPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_dim0(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate equally shaped tensors of all ranks along dim 0 (no autograd)."""
    out, _ = start_all_gather_dim0(tensor, group, async_op=False)
    return out


def reduce_scatter_dim0(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `tensor` over all ranks and return this rank's dim-0 slice (no autograd)."""
    out, _ = start_reduce_scatter_dim0(tensor, group, async_op=False)
    return out


def start_all_gather_dim0(tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = True):
    """`all_gather_dim0` issued without waiting: `(out, work)`; `work.wait()` (None when `async_op=False`) before
    reading `out`. What lets the ring gather the next head chunk while it attends the current one."""
    size = dist.get_world_size(group)
    out = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    return out, _all_gather_single(out, tensor.contiguous(), group=group, async_op=async_op)


def start_reduce_scatter_dim0(tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = True):
    """`reduce_scatter_dim0` issued without waiting: `(out, work)`, as `start_all_gather_dim0`."""
    size = dist.get_world_size(group)
    out = torch.empty((tensor.shape[0] // size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    work = _reduce_scatter_single(out, tensor.contiguous(), op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return out, work


class _AllGatherDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return all_gather_dim0(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return reduce_scatter_dim0(grad_output, ctx.group), None


def all_gather_autograd(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate the tensors of all ranks of `group` along `dim`; the backward sums gradients into the owner.

    Sizes along `dim` may differ between ranks (they are padded to the largest for the collective, which gloo needs,
    and trimmed afterwards); the other dimensions must match. With `group=None` and torch.distributed not initialised,
    or a group of one, the tensor is returned as is.

    Example:
    ```python
    >>> scores = all_gather_autograd(local_scores, groups.ring_group)  # [sum of local sizes]
    >>> loss = -torch.nn.functional.logsigmoid(scores[0::2] - scores[1::2]).mean()  # same on every rank
    ```
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return tensor
    moved = tensor.movedim(dim, 0)
    size = torch.tensor([moved.shape[0]], dtype=torch.long, device=collective_device(group))
    sizes = all_gather_dim0(size, group).tolist()
    longest = max(sizes)
    if longest != moved.shape[0]:
        moved = torch.cat([moved, moved.new_zeros((longest - moved.shape[0], *moved.shape[1:]))])
    gathered = _AllGatherDim0.apply(moved, group)
    if any(s != longest for s in sizes):
        gathered = torch.cat([gathered[i * longest : i * longest + s] for i, s in enumerate(sizes)])
    return gathered.movedim(0, dim)


class _AllToAllDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.contiguous()  # (and so is `out`: empty_like keeps the strides)
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        # Block i went to rank i and came back as its block `rank`: the same exchange returns each gradient block
        # to the rank that sent it.
        grad_output = grad_output.contiguous()
        grad = torch.empty_like(grad_output)
        dist.all_to_all_single(grad, grad_output, group=ctx.group)
        return grad, None


def all_to_all_autograd(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Exchange equal dim-0 blocks: `tensor[i]` (`[P, ...]`, one block per rank) goes to rank i, and the result's block
    i comes from rank i. The backward is the same exchange of the gradients (what Ulysses sequence parallelism moves
    q, k, v and the attention output with).

    Example:
    ```python
    >>> heads = all_to_all_autograd(q.unflatten(1, (P, -1)).transpose(0, 1), group)  # [P, tokens, H / P, D]
    ```
    """
    return _AllToAllDim0.apply(tensor, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_autograd(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum equally shaped tensors over the ranks of `group`; the backward sums the gradients too, the convention of
    `all_gather_autograd` (every rank computing the same loss from the sum: the world average of the parameter
    gradients is the loss's gradient). For values that each rank computes for its own entries, zeros elsewhere.

    Example:
    ```python
    >>> logps = all_reduce_autograd(local_logps_or_zeros, shard.attention_meta.group)  # [P], same on every rank
    ```
    """
    if group is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return tensor
    return _AllReduceSum.apply(tensor, group)


def gather_sequence(local: torch.Tensor, meta, dim: int = 1, trim_padding: bool = True) -> torch.Tensor:
    """Gather a per-token tensor of this rank's slice (e.g. per-token log-probs `[1, local_length]`) into the whole row.

    Gather per-token values, never logits. With `trim_padding`, the padding added by `shard_packed_row` is removed so
    that the result lines up with the unpadded row.

    Example:
    ```python
    >>> logps = gather_sequence(local_logps, shard.attention_meta)  # [1, unpadded_length]
    ```
    """
    if local.shape[dim] != meta.local_length:
        raise ValueError(
            f"gather_sequence: dimension {dim} has {local.shape[dim]} entries but this rank's slice has "
            f"{meta.local_length} tokens."
        )
    full = local if meta.group is None else meta.to_global_order(all_gather_autograd(local, meta.group, dim=dim), dim)
    if trim_padding:
        full = full.narrow(dim, 0, meta.unpadded_length)
    return full


def destroy_process_groups() -> None:
    """Destroy torch.distributed's process groups (the default one and every subgroup), if any.

    Called at exit by the trainers (`trainers.parallel.release_process_groups_at_exit`, after dropping the wrappers
    that keep the groups alive): a gloo group left to the interpreter's finalisation aborted a rank after a successful
    run ("terminate called without an active exception", SIGABRT: the launcher then reports the run as failed;
    `bench/clean_exit.py`). `atexit` runs before finalisation, once the script (and every collective) is done."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

