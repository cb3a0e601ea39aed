"""The Modal app: an image built from this checkout's lock file, a cache volume, three functions.

Defining it contacts nobody; `app.run()` (weft.remote.cli, weft.remote.pytest_plugin) does.
Each function is declared on DEFAULT_GPU; callers pick another with `.with_options(gpu=...)`.
"""

from __future__ import annotations

from collections.abc import Iterator

import modal

from weft.remote import worker
from weft.remote.preflight import DEFAULT_GPU
from weft.remote.worker import ROOT, NodeResult

CACHE = "/cache"  # the volume: the dequantized default model, HF's downloads

image = (
    modal.Image.debian_slim(python_version="3.11")
    .uv_sync(str(ROOT))  # pyproject.toml and uv.lock, frozen: the same packages as here
    .env({"WEFT_CACHE": f"{CACHE}/weft", "HF_HOME": f"{CACHE}/huggingface"})
    # the checkout's layout under /root (on the container's PYTHONPATH): pytest finds its config there
    .add_local_python_source("weft")
    .add_local_dir(ROOT / "tests", "/root/tests", ignore=["**/__pycache__", "**/*.pyc"])
    .add_local_file(ROOT / "main.py", "/root/main.py")
    .add_local_file(ROOT / "conftest.py", "/root/conftest.py")
    .add_local_file(ROOT / "pyproject.toml", "/root/pyproject.toml")
)
cache = modal.Volume.from_name("weft-cache", create_if_missing=True)
app = modal.App("weft", image=image)


@app.function(gpu=DEFAULT_GPU, volumes={CACHE: cache}, timeout=30 * 60)
def gate(argv: list[str]) -> Iterator[str | int]:
    """main.py on the GPU: its lines as they come, then its exit status."""
    yield from worker.gate(argv)


@app.function(gpu=DEFAULT_GPU, volumes={CACHE: cache}, timeout=10 * 60)
def collect(args: list[str]) -> list[str]:
    """The node ids pytest selects on the GPU (parametrizations depend on CUDA being there)."""
    return worker.collect(args)


@app.function(gpu=DEFAULT_GPU, volumes={CACHE: cache}, timeout=60 * 60)
def run_node(nodeid: str, git_sha: str) -> NodeResult:
    """One test case: the serving runs of the largest perf cases take tens of minutes."""
    return worker.run_node(nodeid, git_sha)
