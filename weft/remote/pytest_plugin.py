"""`pytest --modal [--modal-gpu TYPE]`: the selected tests run on Modal GPUs, a container per case.

Registered by the root conftest.py; without --modal it adds two options and nothing else
(Modal is not even imported). The session's Modal side is weft.remote.session.
"""

from __future__ import annotations

import pytest

from weft.remote.preflight import DEFAULT_GPU, ModalUnavailable, preflight


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("modal", "run on Modal GPUs")
    group.addoption("--modal", action="store_true", help="run the selected tests on Modal GPUs, a container each")
    group.addoption("--modal-gpu", default=DEFAULT_GPU, metavar="TYPE", help="Modal GPU type (default: %(default)s)")


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("modal"):
        return
    if config.getoption("numprocesses", None):
        raise pytest.UsageError("--modal fans the tests out by itself: drop -n")
    try:
        gpu = preflight(config.getoption("modal_gpu"))
    except ModalUnavailable as e:
        raise pytest.UsageError(str(e)) from None
    from weft.remote.session import ModalRun

    config.pluginmanager.register(ModalRun(config, gpu), "weft-modal")
