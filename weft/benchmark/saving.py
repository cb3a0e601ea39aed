"""Saving a perf session's benchmarks before it ends: a run cut short by a device's time limit keeps what it
finished. Light (no torch): a pytest session that only saves imports it."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO

import pytest


class JsonTarget(os.PathLike):
    """--benchmark-json's file, writable any number of times: pytest-benchmark >= 5.3 opens the path
    it is given, older ones write `with session.json as fh`, which closes an already open file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)

    __str__ = __fspath__

    def __enter__(self) -> BinaryIO:
        self.file = self.path.open("wb")
        return self.file

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def save_so_far(config: pytest.Config) -> None:
    """With --benchmark-json, rewrite that file now with every benchmark so far: pytest-benchmark
    writes it only when the session ends, and a run cut short by a time limit would leave nothing."""
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.json or session.save or session.autosave:
        return
    if not isinstance(session.json, JsonTarget):
        if isinstance(session.json, io.IOBase):  # pytest-benchmark < 5.3 opened the file itself
            session.json.close()
            session.json = JsonTarget(Path(session.json.name))
        else:
            session.json = JsonTarget(Path(session.json))
    session.handle_saving()
