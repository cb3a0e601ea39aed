"""The Modal side of a `pytest --modal` session (see weft.remote.pytest_plugin).

Collection happens twice. Here it decides what was selected (paths, -m, -k); on the GPU it
decides the cases, since parametrizations follow the device (perf sizes, attention backends).
The GPU's node ids become this session's items, all started when collection ends; each item
waits for its own result and reports it as its own: outcome, remote traceback, and a perf
test's benchmark record, which pytest-benchmark then saves as it would a local one.
A run that does not finish (interrupted, Modal lost) saves no benchmark at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import modal
import modal.exception
import pytest
from pytest_benchmark.stats import Metadata

from weft.remote.fanout import LOST_MODAL, FanOut
from weft.remote.worker import CollectionError, NodeResult


class RemoteFailure(Exception):
    """A case that failed on the GPU; the message is pytest's report of it there."""


class RemoteItem(pytest.Item):
    """A case collected on the GPU: it runs there; here it waits for its result and reports it."""

    def __init__(self, *, run: ModalRun, **kwargs) -> None:
        super().__init__(**kwargs)
        self.run = run

    @classmethod
    def for_nodeid(cls, session: pytest.Session, nodeid: str, run: ModalRun) -> RemoteItem:
        path, _, name = nodeid.partition("::")
        return cls.from_parent(session, name=name, nodeid=nodeid, path=session.config.rootpath / path, run=run)

    def runtest(self) -> None:
        result = self.run.result(self.nodeid)
        if result.outcome == "skipped":
            pytest.skip(result.longrepr)
        if result.outcome == "failed":
            raise RemoteFailure(result.longrepr)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException]) -> str:
        if isinstance(excinfo.value, RemoteFailure):
            return f"on Modal ({self.run.gpu}):\n{excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple:
        return self.path, None, self.name


def as_metadata(record: dict, gpu: str) -> Metadata:
    """A stored pytest-benchmark record as the live object pytest-benchmark saves and tabulates."""
    fixture = SimpleNamespace(
        name=record["name"],
        fullname=record["fullname"],
        group=record["group"],
        param=record["param"],
        params=record["params"],
        extra_info={**record["extra_info"], "modal_gpu": gpu},
        cprofile_stats=None,
        has_error=False,
    )
    stats = record["stats"]
    metadata = Metadata(fixture, iterations=stats["iterations"], options=record["options"])
    for value in stats["data"]:  # per-iteration times: the same statistics as on the GPU
        metadata.stats.update(value)
    return metadata


@contextmanager
def _stops_on_modal_errors(doing: str) -> Iterator[None]:
    """Modal failing outside any one case ends the session with its message, not a traceback."""
    try:
        yield
    except (modal.exception.Error, CollectionError, *LOST_MODAL) as e:
        pytest.exit(f"modal: {doing} failed: {e}")


class ModalRun:
    """The session's Modal side: the running app, the started cases, what their results said."""

    def __init__(self, config: pytest.Config, gpu: str) -> None:
        self.config = config
        self.gpu = gpu
        self.app = ExitStack()  # app.run(), from the first remote call to the end of the session
        self.run_node: modal.Function | None = None
        self.nodeids: list[str] = []  # the cases, as collected on the GPU
        self.fanout: FanOut | None = None
        self.machine_info: dict | None = None

    def _say(self, line: str) -> None:
        self.config.pluginmanager.get_plugin("terminalreporter").write_line(f"modal: {line}")

    def _start_app(self) -> modal.Function:
        """Run the app for the rest of the session; its collect function, on the session's GPU."""
        from weft.remote import app

        self._say(f"starting app {app.app.name!r} on {self.gpu} (its first run builds the image: minutes)")
        self.app.enter_context(app.app.run())
        self.run_node = app.run_node.with_options(gpu=self.gpu)
        return app.collect.with_options(gpu=self.gpu)

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> Iterator[None]:
        # the test functions collected here, before -m/-k deselect any: those apply on the GPU
        functions = list(dict.fromkeys(item.nodeid.split("[")[0] for item in items))
        result = yield
        selection = functions
        if config.option.markexpr:
            selection += ["-m", config.option.markexpr]
        if config.option.keyword:
            selection += ["-k", config.option.keyword]
        with _stops_on_modal_errors("collecting on the GPU"):
            self.nodeids = self._start_app().remote(selection) if functions else []
        items[:] = [RemoteItem.for_nodeid(session, nodeid, self) for nodeid in self.nodeids]
        return result

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # pytest calls this even when collection stopped; then there is nothing to start
        if self.config.option.collectonly or not self.nodeids:
            return
        from weft.benchmark.environment import git_sha

        with _stops_on_modal_errors("starting the cases"):
            self.fanout = FanOut.start(self.run_node, self.nodeids, self.gpu, git_sha())
        self._say(f"{len(self.nodeids)} cases started, one {self.gpu} container each; results follow as they finish")

    def result(self, nodeid: str) -> NodeResult:
        try:
            result = self.fanout.result(nodeid)
        except LOST_MODAL as e:
            pytest.exit(f"modal: lost the connection ({e}): the run did not finish; no results saved")
        if result.benchmark is not None:
            self.machine_info = self.machine_info or result.machine_info
            bench = self.config.pluginmanager.get_plugin("pytest-benchmark")
            bench.benchmarks.append(as_metadata(result.benchmark, self.gpu))
        return result

    def pytest_benchmark_update_machine_info(self, config: pytest.Config, machine_info: dict) -> None:
        """The saved run describes the machine that measured it, not this one."""
        if self.machine_info:
            machine_info.clear()
            machine_info.update(self.machine_info)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> Iterator[None]:
        # before pytest-benchmark saves: a run that did not finish leaves results/ as it was
        if exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR):
            self.config.pluginmanager.get_plugin("pytest-benchmark").benchmarks.clear()
        return (yield)

    def pytest_unconfigure(self) -> None:
        self.app.close()
