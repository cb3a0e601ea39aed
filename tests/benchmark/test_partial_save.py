"""A perf session cut short (a device time limit) still leaves the benchmarks it finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[2]

INNER_TEST = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from tests.perf.conftest import save_so_far

def test_first(benchmark, request):
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info["experiment"] = "first"
    save_so_far(request.config)

def test_killed(benchmark, request):
    os._exit(3)  # what a timeout's SIGKILL does: no session end, no pytest-benchmark saving
"""


@pytest.mark.parametrize("save_so_far_called", [True, False])
def test_finished_benchmarks_survive_a_killed_session(pytester, tmp_path, outside_xdist, save_so_far_called):
    source = INNER_TEST if save_so_far_called else INNER_TEST.replace("    save_so_far(request.config)\n", "")
    pytester.makepyfile(test_inner=source)
    out = tmp_path / "run.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--benchmark-json={out}")
    assert result.ret == 3
    if not save_so_far_called:  # pytest-benchmark alone: nothing survives
        assert not out.exists() or out.read_text() == ""
        return
    benchmarks = json.loads(out.read_text())["benchmarks"]
    assert [b["extra_info"]["experiment"] for b in benchmarks] == ["first"]
