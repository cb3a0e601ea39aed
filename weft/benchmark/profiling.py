"""Where a run's time goes: torch.profiler's top operators per engine tick (e7), and a step's wall time,
GPU busy and idle time and GPU time by kernel class (e13)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def top_ops(
    fn: Callable[[], T], device: torch.device, ticks: Callable[[T], int], top: int = 10
) -> tuple[T, list[dict]]:
    """Runs `fn` under the profiler -> (its result, the `top` ops by self time).

    On CUDA the ops are the GPU's own (kernels, copies) by device time: an `aten::` op's device
    time is that of the kernels it launched, so listing both would count them twice. Off CUDA
    they are operators by CPU time. Each is reported per tick, `ticks(result)` the run's ticks.
    """
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        result = fn()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if not cuda or e.device_type == DeviceType.CUDA]
    events = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:top]
    n = max(ticks(result), 1)
    return result, [
        {"op": e.key, "calls_per_tick": e.count / n, "self_ms_per_tick": getattr(e, attr) / 1e3 / n}
        for e in events
    ]


# A GPU kernel's class, by the first pattern its name contains (lower case); the rest is "other".
KERNEL_CLASSES = (
    ("attention", ("_split_kernel", "_merge", "_prefill_kernel", "_grouped_kernel", "attention", "flash", "fmha")),
    ("kv write", ("_write_kernel",)),  # only where attention stores K/V itself (slots that are not cache rows)
    ("norm", ("rms_norm",)),
    ("rope", ("_rotary",)),  # with Qwen3's q/k RMSNorms, and the K/V store where the backend gives cache_slots
    ("activation", ("_silu",)),
    # `_rope_kernel`: qkv's decode matmul, with RoPE, the q/k norms and the K/V store in its epilogue
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "sm90", "splitk", "_matmul_kernel",
              "_rope_kernel")),
    ("sampling", ("sort", "topk", "argmax", "softmax", "exponential", "max_")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, patterns in KERNEL_CLASSES if any(p in low for p in patterns)), "other")


def step_profile(step: Callable[[], object], steps: int, device: torch.device) -> dict[str, object]:
    """Runs `step` `steps` times as it runs in service, then `steps` times under the profiler -> per step: wall
    ms of the first run (host clock, the device synchronized at both ends: the profiler's own cost per op
    is left out), and on CUDA, from the second, the ms the GPU was busy (the union of its kernels' intervals),
    idle (wall - busy) and GPU ms by kernel class (KERNEL_CLASSES)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    result: dict[str, object] = {"profiled_steps": steps, "step_ms": wall_ms, "gpu_busy_ms": None,
                                 "gpu_idle_ms": None, "gpu_ms_by_class": None}
    if not cuda:
        return result
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    busy_us, reach = 0.0, float("-inf")
    by_class: dict[str, float] = {}
    for begin, end, name in kernels:
        busy_us += max(0.0, end - max(begin, reach))  # overlapping kernels count once
        reach = max(reach, end)
        by_class[kernel_class(name)] = by_class.get(kernel_class(name), 0.0) + (end - begin) / 1e3 / steps
    busy_ms = busy_us / 1e3 / steps
    return result | {"gpu_busy_ms": busy_ms, "gpu_idle_ms": max(wall_ms - busy_ms, 0.0),
                     "gpu_ms_by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1]))}
