"""Where a run's time goes, op by op: torch.profiler's top operators, per engine tick."""

from __future__ import annotations

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
