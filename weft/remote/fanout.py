"""One container per test case: every case started at once, each result collected on its own.

A case whose call fails (it raised, it timed out, its container died) is that case's failure;
losing Modal itself is not a case's doing, and is raised for the whole run to stop.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from dataclasses import dataclass

import modal
import modal.exception

from weft.remote.worker import NodeResult

# The connection to Modal is gone: no other case's result will come either.
LOST_MODAL = (modal.exception.ConnectionError, modal.exception.AuthError, OSError)


@dataclass
class FanOut:
    """The session's cases on Modal, by node id."""

    gpu: str
    calls: dict[str, modal.FunctionCall]  # node id -> its call, until its result is taken

    @classmethod
    def start(cls, run_node: modal.Function, nodeids: Iterable[str], gpu: str, git_sha: str) -> FanOut:
        """Spawn `run_node` (on its GPU) once per node id, without waiting for any."""
        return cls(gpu, {nodeid: run_node.spawn(nodeid, git_sha) for nodeid in nodeids})

    def result(self, nodeid: str) -> NodeResult:
        """Wait for one case; what went wrong with its call becomes its failure, traceback and all."""
        call = self.calls.pop(nodeid)
        try:
            return call.get()
        except LOST_MODAL:
            raise
        except Exception as e:
            trace = "".join(traceback.format_exception(e))
            return NodeResult(nodeid, "failed", f"the Modal call on {self.gpu} failed:\n{trace}")
