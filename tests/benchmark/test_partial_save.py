"""A perf session cut short (a device time limit) still leaves the benchmarks it finished,
and one that is not cut short still saves them all at its end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[2]

INNER_TEST = f"""
import os, sys
import pytest
sys.path.insert(0, {str(ROOT)!r})
from weft.benchmark.saving import save_so_far

@pytest.mark.parametrize("name", ["first", "second"])
def test_benchmark(benchmark, request, name):
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info["experiment"] = name
    if os.environ["SAVE_SO_FAR"] == "1":
        save_so_far(request.config)

def test_last():
    if os.environ["KILLED"] == "1":
        os._exit(3)  # what a timeout's SIGKILL does: no session end, no pytest-benchmark saving
"""


@pytest.mark.parametrize(
    ("save_so_far_called", "killed", "saved"),
    [(True, True, ["first", "second"]), (False, True, []), (True, False, ["first", "second"])],
    ids=["killed", "killed-without-save-so-far", "finished"],
)
def test_finished_benchmarks_are_saved(
    pytester, tmp_path, monkeypatch, outside_xdist, save_so_far_called, killed, saved
):
    monkeypatch.setenv("SAVE_SO_FAR", str(int(save_so_far_called)))
    monkeypatch.setenv("KILLED", str(int(killed)))
    pytester.makepyfile(test_inner=INNER_TEST)
    out = tmp_path / "run.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--benchmark-json={out}")
    assert result.ret == (3 if killed else 0), result.stdout.str()[-2000:]
    found = json.loads(out.read_text())["benchmarks"] if out.exists() and out.read_text() else []
    assert [b["extra_info"]["experiment"] for b in found] == saved
