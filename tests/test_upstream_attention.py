"""Our varlen kernels through the real Python layers of flash-attn 2.8 and of torch's `varlen_attn`, on CPU tensors
(`upstream_attention`: flash-attn's interface from its source distribution with an emulated compiled extension, and
torch's own wrapper with CPU kernels for its custom ops), against the pure-PyTorch reference: fp32 at 1e-5 where the
emulation lets float32 through, bf16 with the extension's own dtype check on."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from test_sequence_parallel_attention import CASES, _check_ring_attention, emulated_ring, reference_with_grads
from test_shared_prefix import ROWS, assert_all_close, emulated_shared_ring, random_problem, reference, shared_layout
from upstream_attention import (
    flash_attn_source,
    forget_flash_attn,
    install_flash_attn,
    torch_varlen_cpu_kernels,
    uninstall_flash_attn,
)

from trl_longrm.sequence_parallel import attention
from trl_longrm.sequence_parallel.kernels import (
    FlashAttnVarlenOps,
    SharedPrefixVarlenKernel,
    TorchVarlenOps,
    VarlenKernel,
    _flash_attn_varlen,
    _torch_varlen_function,
    is_flash_attn_available,
)
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks


PRELOAD = ("trl_longrm.testing_utils",)


def test_a_flash_attn_4_only_install_counts_as_absent(tmp_path, monkeypatch):
    """flash-attn-4 installs `flash_attn.cute` only: `import flash_attn` succeeds as a namespace package, but there is
    no flash-attn 2 interface, so the kernels must not pick it."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import flash_attn  # noqa: F401 - the namespace package imports

        assert not is_flash_attn_available()
    finally:
        forget_flash_attn()


@pytest.fixture(scope="module")
def flash_attn():
    """flash-attn's real interface with the emulated extension (float32 let through for exact comparisons)."""
    source = flash_attn_source()
    emulation = install_flash_attn(source, allow_float32=True)
    yield emulation
    uninstall_flash_attn(source)


def flash_kernel():
    return VarlenKernel("flash_attn", _flash_attn_varlen, FlashAttnVarlenOps.load())


def test_flash_attn_backward_is_found_through_its_custom_op(flash_attn):
    """flash-attn >= 2.7 wraps `_flash_attn_varlen_backward` in a `torch.library` custom op whose signature is
    `(*args, **kwargs)`; the ops are found through the wrapped function's."""
    from flash_attn import flash_attn_interface

    assert is_flash_attn_available()
    assert list(inspect.signature(flash_attn_interface._flash_attn_varlen_backward).parameters) == ["args", "kwargs"]
    ops = FlashAttnVarlenOps.load()
    assert ops is not None
    assert {"window_size_left", "window_size_right", "deterministic", "softcap"} <= ops._backward_parameters


def test_auto_prefers_cudnn_over_flash_attn_2_from_hopper_on(flash_attn, monkeypatch, caplog):
    """With flash-attn 2 installed (its real interface, emulated extension), 'auto' on CUDA half-precision tensors
    takes cuDNN's fused attention on Hopper and newer (1.8x flash-attn 2's rate on an H200) and flash-attn 2 on older
    cards; the choice and its reason are logged once; a plan made for such a card traces the same kernels. Resolution
    only: nothing runs on CUDA."""
    import logging

    from trl_longrm.memory_plan.planned_kernels import planned_cuda_attention
    from trl_longrm.sequence_parallel import kernels

    assert is_flash_attn_available()
    cuda = torch.device("cuda")
    for capability, expected, planned in (((9, 0), "torch_cudnn", "cudnn"), ((10, 0), "torch_cudnn", "cudnn"),
                                          ((8, 0), "flash_attn", "flash_attn"), ((8, 9), "flash_attn", "flash_attn")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, _c=capability: _c)
        kernels._log_auto_choice.cache_clear()
        with caplog.at_level(logging.INFO, logger=kernels.__name__):
            caplog.clear()
            assert kernels.resolve_kernel("auto", cuda, torch.bfloat16).name == expected
            kernels.resolve_kernel("auto", cuda, torch.bfloat16)  # logged once, not per attention call
        said = [r.getMessage() for r in caplog.records if "resolved to" in r.getMessage()]
        assert len(said) == 1 and f"compute capability {capability[0]}.{capability[1]}" in said[0], said
        assert planned_cuda_attention("auto", capability) == planned
    # Where torch lacks cuDNN's ops, Hopper takes flash-attn 2.
    monkeypatch.setattr(kernels.TorchCudnnOps, "load", classmethod(lambda cls, min_tokens=2048: None))
    assert kernels.auto_backend(cuda, torch.float16, (9, 0))[0] == "flash_attn"
    assert kernels.auto_backend(cuda, torch.float32, (9, 0))[0] == "torch"


@pytest.mark.parametrize("head_dim", [8, 12], ids=["head_dim_8", "head_dim_12"])
@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads,doc_lengths", CASES)
def test_flash_attn_kernel_on_emulated_ring(flash_attn, num_heads, num_kv_heads, doc_lengths, group_size, head_dim):
    """Packed rows through `flash_attn_varlen_func` (its autograd function, its head-dim padding), the ring's slices
    and key ranges, GQA: equal to the reference in fp32."""
    length, scaling = sum(doc_lengths), 0.25
    q, k, v, grad_out = random_problem(num_heads, num_kv_heads, length, seed=group_size, head_dim=head_dim)
    expected = reference_with_grads(q, k, v, grad_out, doc_lengths, scaling)
    expected = (expected[0], *(grad.transpose(0, 1) for grad in expected[1:]))
    got = emulated_ring(flash_kernel(), q, k, v, grad_out, doc_lengths, group_size, chunk=3, scaling=scaling)
    for name, g, e in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert {call[0] for call in flash_attn.calls} == {"varlen_fwd", "varlen_bwd"}


@pytest.mark.parametrize("head_dim", [8, 12], ids=["head_dim_8", "head_dim_12"])
@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("row", ROWS, ids=["three_groups", "with_unshared_document"])
def test_flash_attn_shared_prefix_merge(flash_attn, row, group_size, head_dim):
    """Shared-prefix rows through flash-attn's forward-with-lse and its varlen backward op (the merge's backward
    from the merged out and lse; our padding of a head dim that is not a multiple of 8, which the kernel refuses)."""
    lengths, parents, _ = shared_layout(row)
    q, k, v, grad_out = random_problem(6, 3, sum(lengths), seed=group_size, head_dim=head_dim)
    expected = reference(q, k, v, grad_out, row, 0.3)
    kernel = SharedPrefixVarlenKernel(FlashAttnVarlenOps.load())
    flash_attn.calls.clear()
    got, _ = emulated_shared_ring(q, k, v, grad_out, lengths, parents, group_size, 1024, 0.3, kernel)
    assert_all_close(got, expected, f"flash-attn merge, ring of {group_size}")
    assert all(call[1]["head_dim"] % 8 == 0 for call in flash_attn.calls)
    assert any(call[0] == "varlen_bwd" and not call[1]["causal"] for call in flash_attn.calls)  # the prefix call


def test_flash_attn_in_bf16_with_the_extension_dtype_check(flash_attn, monkeypatch):
    """The extension takes fp16/bf16 only: float32 is refused by it, bf16 runs and is close to the fp32 reference."""
    monkeypatch.setattr(flash_attn, "allow_float32", False)
    row = ROWS[0]
    lengths, parents, _ = shared_layout(row)
    q, k, v, grad_out = random_problem(4, 2, sum(lengths), seed=1, head_dim=16)
    q, k, v, grad_out = (t.bfloat16().float() for t in (q, k, v, grad_out))
    expected = reference(q, k, v, grad_out, row, 0.3)
    kernel = SharedPrefixVarlenKernel(FlashAttnVarlenOps.load())
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        emulated_shared_ring(q, k, v, grad_out, lengths, parents, 1, 1024, 0.3, kernel)
    bf16 = [t.bfloat16() for t in (q, k, v, grad_out)]
    got, _ = emulated_shared_ring(*bf16, lengths, parents, 2, 1024, 0.3, kernel)
    for name, g, e in zip(["out", "dq", "dk", "dv"], got, expected):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e, atol=3e-2, rtol=3e-2, msg=lambda m, n=name: f"{n}: {m}")


def test_flash_attn_backward_is_deterministic_when_torch_is(flash_attn):
    """`deterministic` follows `torch.use_deterministic_algorithms` (it was hard-coded False)."""
    q, k, v, grad_out = random_problem(4, 2, 12, seed=2, head_dim=8)
    kernel = flash_kernel()
    for wanted in (False, True):
        flash_attn.calls.clear()
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(wanted)
        try:
            emulated_ring(kernel, q, k, v, grad_out, [5, 7], 2, chunk=3, scaling=0.3)
            emulated_shared_ring(q, k, v, grad_out, [5, 3, 4], [-1, 0, 0], 1, 1024, 0.3,
                                 SharedPrefixVarlenKernel(FlashAttnVarlenOps.load()))  # fmt: skip
        finally:
            torch.use_deterministic_algorithms(previous)
        backward_calls = [call[1]["deterministic"] for call in flash_attn.calls if call[0] == "varlen_bwd"]
        assert backward_calls and set(backward_calls) == {wanted}


def _flash_attn_ring_worker(rank, world_size, sequence_parallel_sizes):
    """The gloo ring check of `test_sequence_parallel_attention`, every kernel call going through flash-attn's real
    interface (this process imports it with the emulated extension)."""
    install_flash_attn(flash_attn_source(), allow_float32=True)
    attention.resolve_kernel = lambda *args: flash_kernel()
    for sequence_parallel_size in sequence_parallel_sizes:
        _check_ring_attention(rank, world_size, sequence_parallel_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size,sequence_parallel_sizes", [(2, [2]), (4, [4])])
def test_flash_attn_ring_on_gloo_matches_reference(flash_attn, world_size, sequence_parallel_sizes):
    run_on_gloo_ranks(_flash_attn_ring_worker, world_size, sequence_parallel_sizes, preload=PRELOAD)


# ------------------------------------------------------------------------------------------- torch varlen_attn


def torch_2_11_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                           window_size=(-1, -1)):  # fmt: skip
    """torch 2.11's public `varlen_attn` signature (no `enable_gqa`: grouped-query heads are taken natively), over
    this torch's custom op."""
    is_causal = tuple(window_size) == (-1, 0)
    out, lse, _ = torch.ops.torch_attn._varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, list(window_size),
        query.shape[1] != key.shape[1],
    )  # fmt: skip
    return (out, lse) if return_aux is not None and return_aux.lse else out


@pytest.fixture(params=["torch_2_13", "torch_2_11"])
def torch_varlen(request, monkeypatch):
    """torch's varlen attention on CPU: the installed wrapper (2.13's signature), or 2.11's signature over it."""
    from torch.nn.attention import varlen

    if not hasattr(varlen, "_varlen_attn_backward"):
        pytest.skip(f"torch {torch.__version__} has no varlen attention backward op")
    torch_varlen_cpu_kernels()
    if request.param == "torch_2_11":
        monkeypatch.setattr(varlen, "varlen_attn", torch_2_11_varlen_attn)
    return request.param


@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads,doc_lengths", CASES)
def test_torch_varlen_kernel_on_emulated_ring(torch_varlen, num_heads, num_kv_heads, doc_lengths, group_size):
    """Both signatures of `varlen_attn` are used (2.11's has no `enable_gqa`: it was refused, leaving CUDA packed
    rows on the block kernel), with GQA: equal to the reference in fp32."""
    fn = _torch_varlen_function()
    assert fn is not None, f"{torch_varlen}: varlen_attn not recognised"
    length, scaling = sum(doc_lengths), 0.25
    q, k, v, grad_out = random_problem(num_heads, num_kv_heads, length, seed=group_size)
    expected = reference_with_grads(q, k, v, grad_out, doc_lengths, scaling)
    expected = (expected[0], *(grad.transpose(0, 1) for grad in expected[1:]))
    kernel = VarlenKernel("torch_varlen", fn, TorchVarlenOps.load())
    got = emulated_ring(kernel, q, k, v, grad_out, doc_lengths, group_size, chunk=3, scaling=scaling)
    for name, g, e in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("group_size", [1, 4])
@pytest.mark.parametrize("row", ROWS, ids=["three_groups", "with_unshared_document"])
def test_torch_varlen_shared_prefix_merge(torch_varlen, row, group_size):
    """Shared-prefix rows through `varlen_attn(return_aux=AuxRequest(lse=True))` and torch's backward op."""
    ops = TorchVarlenOps.load()
    assert ops is not None
    lengths, parents, _ = shared_layout(row)
    q, k, v, grad_out = random_problem(6, 3, sum(lengths), seed=group_size)
    expected = reference(q, k, v, grad_out, row, 0.3)
    got, _ = emulated_shared_ring(q, k, v, grad_out, lengths, parents, group_size, 1024, 0.3,
                                  SharedPrefixVarlenKernel(ops))  # fmt: skip
    assert_all_close(got, expected, f"{torch_varlen} merge, ring of {group_size}")
