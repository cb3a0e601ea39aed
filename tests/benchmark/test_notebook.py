"""analysis.ipynb runs headless on the stored runs and draws every experiment's chart."""

import base64
import re
from pathlib import Path

import nbformat
from ipykernel.kernelspec import get_kernel_dict
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

from weft.benchmark import charts
from weft.benchmark.results import gather

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "analysis.ipynb"
PNG = b"\x89PNG\r\n\x1a\n"


class ThisInterpreter(KernelSpecManager):
    """Every kernel name -> this interpreter's ipykernel. A "python3" kernelspec installed for the
    user may run another Python, without weft's dependencies, and a fresh machine may have none:
    the notebook is tested in the environment that runs the tests."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(**get_kernel_dict())


def test_the_notebook_runs_and_draws_every_chart():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = AsyncKernelManager(kernel_name=nb.metadata["kernelspec"]["name"], kernel_spec_manager=ThisInterpreter())
    NotebookClient(nb, km=km, timeout=120, resources={"metadata": {"path": str(ROOT)}}).execute()  # raises on any error

    drawn = {}
    for cell in nb.cells:
        shown = re.fullmatch(r'show\("(\w+)"\)', cell.source.strip()) if cell.cell_type == "code" else None
        if shown:
            images = [o["data"]["image/png"] for o in cell.outputs if "image/png" in o.get("data", {})]
            drawn[shown[1]] = [base64.b64decode(image) for image in images]
    assert set(charts.CHARTS) <= set(drawn)
    stored = set(gather([], [], ROOT / "results").records()["experiment"])
    for experiment, images in drawn.items():
        assert len(images) == (experiment in charts.CHARTS and experiment in stored), experiment
        assert all(image.startswith(PNG) and len(image) > 10_000 for image in images), experiment
