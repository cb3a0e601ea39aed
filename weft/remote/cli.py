"""`main.py --modal` and `main.py --collect`: the gate and the perf experiments on Modal GPUs.

Callers run weft.remote.preflight first. Modal is imported here only when a run starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

from weft.remote.worker import ROOT

PERF_TESTS = ROOT / "tests" / "perf"


def experiments() -> dict[str, Path]:
    """The perf experiments by name (e1, e2, ...): tests/perf/test_e1_backend_sweep.py is e1."""
    found = {path.name.split("_")[1]: path for path in PERF_TESTS.glob("test_e*_*.py")}
    return dict(sorted(found.items(), key=lambda item: int(item[0][1:])))  # e1, e2, ..., e9, e11


def gate(argv: list[str], gpu: str) -> int:
    """main.py `argv` on a Modal GPU, its lines printed here as they come; its exit status."""
    import modal

    from weft.remote.app import app
    from weft.remote.app import gate as remote_gate

    status = 1  # unless the remote main.py says otherwise
    try:
        with modal.enable_output(), app.run():  # the output: the image build, the first time
            for item in remote_gate.with_options(gpu=gpu).remote_gen(argv):
                if isinstance(item, int):
                    status = item
                else:
                    print(item, flush=True)
    except (modal.exception.Error, OSError) as e:
        print(f"modal: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return status


def collect(names: list[str], gpu: str) -> int:
    """The named perf experiments (or "all"), a GPU per case; results/ gets what a local run writes.

    It is `pytest -m perf --modal` on their modules: pytest-benchmark stores the records.
    """
    import pytest

    known = experiments()
    chosen = known if "all" in names else {name: known[name] for name in names}
    return int(pytest.main(["-m", "perf", "--modal", f"--modal-gpu={gpu}", *map(str, chosen.values())]))
