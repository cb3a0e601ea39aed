"""What every benchmark record says about where and what it measured, and the timer of the kernel experiments."""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


@functools.cache
def git_sha() -> str:
    """The commit measured, with '-dirty' when the tree has uncommitted changes.

    $WEFT_GIT_SHA, when set, names it: a `git archive` export measured on another machine
    may sit inside some other checkout, whose HEAD is not what runs. Else git; else 'unknown'.
    """
    if os.environ.get("WEFT_GIT_SHA"):
        return os.environ["WEFT_GIT_SHA"]
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def device_name(device: torch.device | str) -> str:
    """'NVIDIA H200' on CUDA; 'cpu' otherwise."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.cache
def copy_bandwidth_gbps(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth, counting bytes read plus bytes written (GB/s)."""
    import triton.testing

    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def kernel_environment(device: torch.device) -> dict[str, object]:
    """What a kernel record says about where it was measured: gpu, git_sha, copy_gbps (None off CUDA)."""
    return {
        "gpu": device_name(device),
        "git_sha": git_sha(),
        "copy_gbps": copy_bandwidth_gbps() if device.type == "cuda" else None,
    }


def launched_seconds(fn: Callable[[], object]) -> float:
    """Median seconds per call, launched from Python one call at a time (do_bench, L2 flushed
    before each); on the CPU one call by the host clock."""
    fn()  # compile / warm up
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def graph_seconds(fns: list[Callable[[], object]], rounds: int = 5) -> float:
    """Median GPU seconds per call: `fns` (one per copy of the data) captured in one CUDA graph, replayed ROUNDS
    times after a warm-up."""
    for fn in fns:
        fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times) / len(fns)
