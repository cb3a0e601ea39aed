"""`pytest --modal` end to end, with Modal replaced at its boundary.

The fakes below stand in for what Modal's SDK gives weft: `app.run()`, and the functions'
`with_options`, `remote` (collection) and `spawn`, whose calls answer `get` from a table of
results instead of from containers. Everything on weft's side of those calls is the real code.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import modal.exception
import pytest

from weft.benchmark.results import load_run
from weft.remote import app, pytest_plugin
from weft.remote.worker import CollectionError, NodeResult

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.usefixtures("outside_xdist")

TESTS = """
import pytest

def test_timed(benchmark):
    benchmark.extra_info.update(experiment="e0", gpu="cpu", git_sha="0123abcd")
    benchmark.pedantic(sum, args=([1, 2, 3],), rounds=4)

def test_passes_here():
    pass

@pytest.mark.parametrize("n", [1])  # the CPU's matrix; the GPU's has other cases
def test_sizes(n):
    pass
"""


class FakeCall:
    """A modal.FunctionCall that answers `get` with its case's result, or raises it."""

    def __init__(self, answer: NodeResult | BaseException, log: list[str]) -> None:
        self.answer, self.log = answer, log

    def get(self, timeout: float | None = None) -> NodeResult:
        self.log.append("get")
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class FakeFunction:
    """A modal.Function (`collect` and `run_node`): the GPU's node ids and each case's answer."""

    def __init__(self, answers: dict[str, NodeResult | BaseException], log: list[str]) -> None:
        self.answers, self.log = answers, log

    def with_options(self, *, gpu: str) -> FakeFunction:
        self.log.append(f"gpu {gpu}")
        return self

    def remote(self, args: list[str]) -> list[str]:
        self.log.append(f"collect {' '.join(args)}")
        return list(self.answers)

    def spawn(self, nodeid: str, git_sha: str) -> FakeCall:
        self.log.append("spawn")
        return FakeCall(self.answers[nodeid], self.log)


@pytest.fixture
def modal_boundary(monkeypatch):
    """answer(table) -> the call log: what the fake Modal was asked, in order."""

    def answer(answers: dict[str, NodeResult | BaseException]) -> list[str]:
        log: list[str] = []
        fake = FakeFunction(answers, log)
        monkeypatch.setattr(pytest_plugin, "preflight", str.upper)  # no credentials, no network here
        monkeypatch.setattr(app.app, "run", contextlib.nullcontext)
        monkeypatch.setattr(app, "collect", fake)
        monkeypatch.setattr(app, "run_node", fake)
        return log

    return answer


@pytest.fixture
def local_record(pytester) -> dict:
    """What a local run of test_timed stores: the record the GPU would send back."""
    pytester.makepyfile(test_remote=TESTS)
    assert pytester.runpytest("test_remote.py::test_timed", "--benchmark-json=local.json").ret == 0
    return json.loads((pytester.path / "local.json").read_text())


def run_on_modal(pytester, *args: str) -> pytest.RunResult:
    storage = f"--benchmark-storage=file://{pytester.path / 'results'}"
    return pytester.runpytest("-p", "weft.remote.pytest_plugin", "--modal", "--modal-gpu=l40s", storage, *args)


def saved_runs(pytester) -> list[Path]:
    return sorted((pytester.path / "results").rglob("*.json"))


def test_cases_fan_out_and_report_their_own_results(pytester, modal_boundary, local_record):
    remote_machine = {**local_record["machine_info"], "node": "modal-container"}
    log = modal_boundary({
        "test_remote.py::test_timed": NodeResult(
            "test_remote.py::test_timed", "passed", benchmark=local_record["benchmarks"][0],
            machine_info=remote_machine,
        ),
        "test_remote.py::test_passes_here": NodeResult(
            "test_remote.py::test_passes_here", "failed", "E   AssertionError: tokens diverge at 3 (on the GPU)"
        ),
        "test_remote.py::test_sizes[2048]": modal.exception.FunctionTimeoutError("timed out after 3600 s"),
        "test_remote.py::test_sizes[4096]": NodeResult("test_remote.py::test_sizes[4096]", "skipped", "too big"),
    })  # fmt: skip
    result = run_on_modal(pytester, "-rs", "--benchmark-save=modal")

    result.assert_outcomes(passed=1, failed=2, skipped=1)
    assert log[:2] == ["gpu L40S", "gpu L40S"]
    assert log[2].startswith("collect test_remote.py::test_timed test_remote.py::test_passes_here")
    assert log[3:] == ["spawn"] * 4 + ["get"] * 4, "every case starts before any is waited for"
    result.stdout.fnmatch_lines([
        "*on Modal (L40S):*", "E   AssertionError: tokens diverge at 3 (on the GPU)",
        "*FunctionTimeoutError: timed out after 3600 s*", "SKIPPED*too big",
    ])  # fmt: skip
    (saved,) = saved_runs(pytester)
    stored = json.loads(saved.read_text())
    assert stored["machine_info"] == remote_machine
    (record,) = stored["benchmarks"]
    local = local_record["benchmarks"][0]
    assert record["extra_info"] == {**local["extra_info"], "modal_gpu": "L40S"}
    assert record["stats"] == {k: v for k, v in local["stats"].items() if k != "data"}
    assert {k: record[k] for k in ("name", "fullname", "params", "options")} == {
        k: local[k] for k in ("name", "fullname", "params", "options")
    }
    assert load_run(saved).records["modal_gpu"].tolist() == ["L40S"]


@pytest.mark.filterwarnings("ignore:Not saving anything")  # pytest-benchmark's words for exactly that
def test_losing_modal_stops_the_run_and_saves_nothing(pytester, modal_boundary, local_record):
    modal_boundary({
        "test_remote.py::test_timed": NodeResult(
            "test_remote.py::test_timed", "passed", benchmark=local_record["benchmarks"][0]
        ),
        "test_remote.py::test_passes_here": modal.exception.ConnectionError("connection reset"),
        "test_remote.py::test_sizes[2048]": NodeResult("test_remote.py::test_sizes[2048]", "passed"),
    })  # fmt: skip
    result = run_on_modal(pytester, "--benchmark-save=modal")

    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*modal: lost the connection (connection reset): the run did not finish*"])
    assert saved_runs(pytester) == []


def test_collection_failing_on_the_gpu_stops_the_run_with_pytests_words(pytester, modal_boundary, monkeypatch):
    log = modal_boundary({})

    class BrokenCollection(FakeFunction):
        def remote(self, args: list[str]) -> list[str]:
            raise CollectionError("pytest exited with status 2:\nE   SyntaxError: invalid syntax")

    monkeypatch.setattr(app, "collect", BrokenCollection({}, log))
    pytester.makepyfile(test_remote=TESTS)
    result = run_on_modal(pytester)

    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*modal: collecting on the GPU failed: pytest exited with status 2:*"])
    assert "spawn" not in log
