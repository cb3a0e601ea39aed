"""What every benchmark record says about where and what it measured."""

from __future__ import annotations

import functools
import os
import subprocess
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
