"""Suite-wide options and fixtures: markers, the GPU skip, and the `--modal` switch."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from pathlib import Path

# Off CUDA the Triton interpreter computes tl.dot with numpy's matmul, and the kernel tests check that a row's
# bits do not depend on where in a tile it sits (as on a GPU's MMA units). OpenBLAS's Haswell and Zen sgemm
# kernels break that (an element's bits change with its row or column in the tile: numpy 2.4's OpenBLAS 0.3.31 on
# an AMD EPYC); its Sandybridge kernel sums each element's products in one order wherever it sits. Set before
# numpy is first imported (torch imports it), so that the xdist workers and child processes inherit it too.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Off CUDA, Triton kernels run in its interpreter, which must be chosen before triton is first
    # imported (transformers' model classes import it): here, before any test module loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["weft.remote.pytest_plugin"]  # --modal, --modal-gpu

ROOT = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """Perf runs are stored under results/ (results/cpu/ off CUDA: never published) unless told otherwise."""
    from weft.benchmark.environment import git_sha

    given = " ".join(config.invocation_params.args)
    cuda = HAS_CUDA or config.getoption("modal", False)  # --modal: measured on a Modal GPU (weft.remote)
    if "--benchmark-storage" not in given:
        config.option.benchmark_storage = f"file://{ROOT / 'results' / ('' if cuda else 'cpu')}"
    if not any(flag in given for flag in ("--benchmark-save", "--benchmark-autosave", "--benchmark-json")):
        config.option.benchmark_save = f"{git_sha()[:12]}_{'cuda' if cuda else 'cpu'}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def outside_xdist() -> Iterator[None]:
    """Pytest sessions a test module starts are not xdist workers, even when the module runs in one (-n):
    they would inherit its PYTEST_XDIST_* variables and skip their perf tests."""
    patch = pytest.MonkeyPatch()
    for var in [v for v in os.environ if v.startswith("PYTEST_XDIST_")]:
        patch.delenv(var)
    yield
    patch.undo()
