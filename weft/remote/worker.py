"""What the Modal functions do in the container; plain Python, so it runs here just the same.

Each job is a fresh `python` process in the checkout's root, started as a user would start it:
a container that serves several inputs carries nothing (modules, models, GPU memory) from one
to the next, and a crash is a result to report rather than the end of the container.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout here; /root in the container
TAIL_CHARS = 4000  # of a crashed process's output: enough for its traceback


class CollectionError(Exception):
    """pytest could not collect what was asked (the message is its output)."""


@dataclass
class NodeResult:
    """How one test went, in the words pytest's own report uses."""

    nodeid: str
    outcome: str  # "passed", "failed" or "skipped"
    longrepr: str = ""  # a failure's traceback, a skip's reason
    benchmark: dict | None = None  # the test's pytest-benchmark record (perf tests)
    machine_info: dict | None = None  # pytest-benchmark's description of the machine that measured it


def _env(git_sha: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if git_sha:
        env["WEFT_GIT_SHA"] = git_sha  # the container's tree has no .git: records say what was sent
    return env


def _pytest(*args: str, git_sha: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(git_sha),
    )


def _tail(done: subprocess.CompletedProcess) -> str:
    return f"pytest exited with status {done.returncode}:\n{(done.stdout + done.stderr)[-TAIL_CHARS:]}"


def gate(argv: list[str]) -> Iterator[str | int]:
    """main.py's lines (stderr's too) as it prints them, then its exit status."""
    with subprocess.Popen(
        [sys.executable, "main.py", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    ) as proc:
        for line in proc.stdout:
            yield line.rstrip("\n")
    yield proc.returncode


def collect(args: list[str]) -> list[str]:
    """The node ids `pytest args` selects here."""
    done = _pytest("--collect-only", "-q", *args)
    if done.returncode == 5:  # pytest.ExitCode.NO_TESTS_COLLECTED, without importing pytest
        return []
    if done.returncode != 0:
        raise CollectionError(_tail(done))
    listing = itertools.takewhile(bool, done.stdout.splitlines())  # node ids, then a blank line, then a summary
    return [line for line in listing if "::" in line]


def run_node(nodeid: str, git_sha: str) -> NodeResult:
    """Run one test, as `pytest NODEID` would; its outcome, and its benchmark record if it made one."""
    with tempfile.TemporaryDirectory() as tmp:
        junit, bench = Path(tmp, "junit.xml"), Path(tmp, "benchmark.json")
        done = _pytest(nodeid, f"--junitxml={junit}", f"--benchmark-json={bench}", git_sha=git_sha)
        case = ET.parse(junit).find(".//testcase") if junit.exists() else None
        if case is None:  # nothing ran: a wrong node id, a crash before or during the test
            return NodeResult(nodeid, "failed", _tail(done))
        result = NodeResult(nodeid, *_outcome(case))
        if bench.exists():
            stored = json.loads(bench.read_text())
            result.benchmark = stored["benchmarks"][0] if stored["benchmarks"] else None
            result.machine_info = stored["machine_info"]
        return result


def _outcome(case: ET.Element) -> tuple[str, str]:
    """JUnit's testcase element: a failure or setup/teardown error, a skip, or neither."""
    for tag in ("failure", "error"):
        problem = case.find(tag)
        if problem is not None:
            return "failed", problem.text or problem.get("message", "")
    skipped = case.find("skipped")
    if skipped is not None:
        return "skipped", skipped.get("message", "")
    return "passed", ""
