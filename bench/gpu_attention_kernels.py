"""What bounds the MFU of a long row on one GPU: the attention kernels this package can use there, alone, at the
Qwen3-0.6B attention shape (16 query heads, 8 key/value heads, head dim 128, bf16, one causal sequence), next to a
large bf16 GEMM (what the chip's matrix units reach in practice).

Per kernel and length: forward and backward milliseconds (CUDA events, median of the timed repeats) and TFLOP/s with
the usual causal attention count (forward 2·S²·H·D, backward 2.5x the forward). `torch_varlen` is torch's
`varlen_attn` (what `ring_attn_backend='auto'` resolves to on a GPU without flash-attn), `sdpa_flash` is SDPA's own
flash backend (`is_causal`), `sdpa_cudnn` SDPA's cuDNN backend where the build has it.

    python bench/gpu_attention_kernels.py --out bench/results/gpu/attention_kernels.json
    python bench/gpu_attention_kernels.py --device cpu --lengths 256 --out -    # rehearsal of the code path on CPU
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B


def _timer(device):
    if device.type == "cuda":

        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)

        return run

    def run(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return run


def _attention_fns(device, dtype):
    """name -> f(q, k, v) with q [S, H, D], k/v [S, KV, D]; only the kernels this torch has on this device."""
    fns = {}
    try:
        from torch.nn.attention.varlen import varlen_attn

        def torch_varlen(q, k, v):
            cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
            extra = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
            return varlen_attn(q, k, v, cu, cu, q.shape[0], q.shape[0], window_size=(-1, 0), **extra)

        if device.type == "cuda":
            fns["torch_varlen"] = torch_varlen
    except ImportError:
        pass
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def fn(q, k, v):
            # [1, H, S, D]; the key/value heads repeated (not every backend takes enable_gqa).
            rep = q.shape[1] // k.shape[1]
            qh, kh, vh = (
                t.transpose(0, 1).unsqueeze(0) for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
            )
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

        return fn

    if device.type == "cuda":
        fns["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        if hasattr(SDPBackend, "CUDNN_ATTENTION"):
            fns["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        fns["sdpa_efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
    else:
        fns["sdpa_cpu_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    return fns


def measure(name, fn, length, device, dtype, repeats):
    timer = _timer(device)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(length, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(length, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(length, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g).requires_grad_()
    forward_ms, backward_ms = [], []
    for i in range(repeats + 1):  # the first is a warm-up
        holder = {}
        f = timer(lambda holder=holder: holder.setdefault("out", fn(q, k, v)))
        grad = torch.ones_like(holder["out"])
        b = timer(lambda holder=holder, grad=grad: holder["out"].backward(grad))
        q.grad = k.grad = v.grad = None
        if i:
            forward_ms.append(f)
            backward_ms.append(b)
    flops_fwd = 2 * length**2 * HEADS * HEAD_DIM
    fwd, bwd = statistics.median(forward_ms), statistics.median(backward_ms)
    return {
        "kernel": name, "length": length, "forward_ms": fwd, "backward_ms": bwd,
        "forward_tflops": flops_fwd / fwd / 1e9, "backward_tflops": 2.5 * flops_fwd / bwd / 1e9,
        "fwd_bwd_tflops": 3.5 * flops_fwd / (fwd + bwd) / 1e9,
    }  # fmt: skip


def gemm_tflops(device, dtype, n, repeats):
    timer = _timer(device)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = [timer(lambda: a @ b) for _ in range(repeats + 1)][1:]
    return {"n": n, "ms": statistics.median(times), "tflops": 2 * n**3 / statistics.median(times) / 1e9}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gemm-n", type=int, default=8192)
    parser.add_argument("--out", required=True, help="JSON file of the results ('-': stdout).")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), torch.bfloat16
    report = {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16", "causal": True},
        "gemm": gemm_tflops(device, dtype, args.gemm_n if device.type == "cuda" else 512, args.repeats),
        "attention": [],
    }
    print(json.dumps(report["gemm"]), flush=True)
    for length in args.lengths:
        for name, fn in _attention_fns(device, dtype).items():
            try:
                record = measure(name, fn, length, device, dtype, args.repeats)
            except (RuntimeError, NotImplementedError) as error:  # a backend this build or shape does not serve
                record = {"kernel": name, "length": length, "error": str(error).splitlines()[0][:300]}
            print(json.dumps(record), flush=True)
            report["attention"].append(record)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    text = json.dumps(report, indent=1)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
