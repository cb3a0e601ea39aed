"""The Modal functions' bodies, run through Modal's local execution path (`Function.local`) on the CPU.

They must give what a local run gives: the gate's lines, a perf test's benchmark record, a
test's outcome with pytest's own report of it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

import main
from weft.benchmark.results import IDENTITY
from weft.remote import app
from weft.remote.worker import CollectionError

# .local() runs here, where the cache volume is not mounted; Modal says so, and that is expected
pytestmark = pytest.mark.filterwarnings("ignore:The .* function is executing locally:UserWarning")

GATE_ARGV = ["--model", "tiny-llama", "--max-tokens", "8", "--device", "cpu"]
PERF_NODE = "tests/perf/test_e5_pool_sweep.py::test_e5_pool_sweep[pool1]"


@pytest.fixture(scope="module", autouse=True)
def slow_runs(outside_xdist) -> Iterator[dict[str, Future]]:
    """The gate and a perf test, started with the module's first test and left to run behind the others.

    Each is a fresh Python importing torch and transformers: the bulk of this module's time.
    """
    with ThreadPoolExecutor(2) as pool:
        yield {
            "gate": pool.submit(lambda: list(app.gate.local(GATE_ARGV))),
            "perf": pool.submit(app.run_node.local, PERF_NODE, "0123abcd"),
        }


def test_failure_and_skip_come_back_as_pytest_reports_them(tmp_path):
    tests = tmp_path / "test_outcomes.py"
    tests.write_text(
        "import pytest\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic is off'\n"
        "def test_skips():\n    pytest.skip('needs a CUDA GPU (none here)')\n"
    )
    failed = app.run_node.local(f"{tests}::test_fails", "0123abcd")
    assert failed.outcome == "failed"
    assert "AssertionError: arithmetic is off" in failed.longrepr
    assert "test_outcomes.py:3: AssertionError" in failed.longrepr
    skipped = app.run_node.local(f"{tests}::test_skips", "0123abcd")
    assert (skipped.outcome, skipped.longrepr) == ("skipped", "needs a CUDA GPU (none here)")
    assert failed.benchmark is skipped.benchmark is None
    absent = app.run_node.local(f"{tests}::test_absent", "0123abcd")  # nothing ran: pytest's own words
    assert absent.outcome == "failed"
    assert "pytest exited with status 4" in absent.longrepr
    assert "not found" in absent.longrepr


def test_collect_lists_node_ids_or_says_why_not(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n@pytest.mark.parametrize('n', [1, 2])\ndef test_n(n): pass\n"
    )
    # node ids are relative to the rootdir, which pytest would otherwise take from where the checkout is
    args = [str(tmp_path / "test_some.py"), f"--rootdir={tmp_path}"]
    assert app.collect.local(args) == ["test_some.py::test_n[1]", "test_some.py::test_n[2]"]
    (tmp_path / "test_broken.py").write_text("def test_x(:\n")
    with pytest.raises(CollectionError, match="SyntaxError"):
        app.collect.local([str(tmp_path / "test_broken.py")])


def untimed(line: str) -> str:
    return re.sub(r", \d+ s\)$", ", N s)", line)


def test_gate_gives_the_lines_of_a_local_run(slow_runs, capsys):
    assert main.main(GATE_ARGV) == 0
    local = capsys.readouterr().out.splitlines()
    *lines, status = slow_runs["gate"].result()
    assert status == 0
    assert [untimed(line) for line in lines] == [untimed(line) for line in local]
    assert lines[-1].startswith("all OK")


def test_perf_node_gives_its_benchmark_record(slow_runs):
    result = slow_runs["perf"].result()
    assert (result.nodeid, result.outcome) == (PERF_NODE, "passed"), result.longrepr
    record = result.benchmark
    assert record["fullname"] == PERF_NODE
    assert set(IDENTITY) <= set(record["extra_info"])
    assert {"config", "makespan_s", "output_tok_s", "ttft_p50_s"} <= set(record["extra_info"])
    assert record["stats"]["data"], "the record carries its timings"
    assert result.machine_info["system"]
