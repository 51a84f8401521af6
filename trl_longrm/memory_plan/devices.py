"""The memory a training process is given on each GPU a plan is checked against: what torch reports as the device's
total memory (`torch.cuda.mem_get_info()[1]`), measured on such a card here, not the name on the box. An "80 GB" H100
gives a process 79.2 GiB; everything the plan counts (the CUDA context included) must fit in that.

    >>> device_memory_bytes("h100-80gb") / 2**30
    79.15
"""

from __future__ import annotations


GIB = 2**30

# name -> bytes a process can allocate from, with where the figure was measured.
DEVICE_MEMORY_BYTES = {
    # NVIDIA H100 80GB HBM3: torch's total memory, 79.2 GiB rounded to 0.1 in bench/results/gpu/gpu.json
    # (`gpu_memory_gib`, five calls); the lower end of that rounding, so a plan that fits here fits there.
    "h100-80gb": int(79.15 * GIB),
    # NVIDIA H200: `torch.cuda.mem_get_info()[1]` in bench/results/gpu/h200/gpu_8b.json (150,109,880,320 bytes,
    # 139.8 GiB; nvidia-smi says 143,771 MiB).
    "h200": 150_109_880_320,
}
DEFAULT_DEVICE = "h100-80gb"


def device_memory_bytes(device: str | None = DEFAULT_DEVICE, memory_gib: float | None = None) -> int:
    """Bytes a process gets on `device` (a name of `DEVICE_MEMORY_BYTES`), or `memory_gib` GiB where given (a card
    not listed: what `torch.cuda.mem_get_info()[1]` reports on it)."""
    if memory_gib is not None:
        return int(memory_gib * GIB)
    if device not in DEVICE_MEMORY_BYTES:
        raise ValueError(
            f"plan_device={device!r} is not a card whose memory was measured ({', '.join(DEVICE_MEMORY_BYTES)}); "
            "give the memory a process gets on it instead: --device_memory_gib (torch.cuda.mem_get_info()[1] / 2**30)."
        )
    return DEVICE_MEMORY_BYTES[device]


__all__ = ["DEFAULT_DEVICE", "DEVICE_MEMORY_BYTES", "device_memory_bytes"]
