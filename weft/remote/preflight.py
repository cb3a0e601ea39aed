"""Checks that fail fast, before Modal would wait on a connection that will not come.

Modal is imported only when a check needs it: importing it reads ~/.modal.toml, which must
not break (or slow down) what runs without Modal.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from modal.config import Config

DEFAULT_GPU = "H100"
# The `gpu=` values Modal documents (modal.com/docs/guide/gpu); Modal upper-cases what it gets.
# A10G is the A10's former name, which Modal still accepts.
GPU_TYPES = (
    "T4", "L4", "A10", "A10G", "L40S", "A100", "A100-40GB", "A100-80GB",
    "RTX-PRO-6000", "H100", "H100!", "H200", "B200", "B200+",
)  # fmt: skip
CONNECT_TIMEOUT_S = 3.0


class ModalUnavailable(Exception):
    """Modal cannot run this: the message says why and what to do (no traceback for the user)."""


def check_gpu(name: str) -> str:
    """The GPU type as Modal spells it, or ModalUnavailable for a type Modal does not offer."""
    gpu = name.upper()
    if gpu not in GPU_TYPES:
        raise ModalUnavailable(f"unknown Modal GPU type {name!r}: choose from {', '.join(GPU_TYPES)}")
    return gpu


def _modal_config() -> Config:
    try:
        from modal.config import config
    except Exception as e:  # modal.exception.InvalidError, raised while modal imports itself
        raise ModalUnavailable(f"Modal's configuration cannot be read: {str(e).strip()}") from None
    return config


def check_credentials() -> None:
    """A token in MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml (Modal's own lookup)."""
    config = _modal_config()
    if not (config.get("token_id") and config.get("token_secret")):
        raise ModalUnavailable(
            "no Modal credentials: run `uv run modal token new` once (or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)"
        )


def check_reachable(timeout: float = CONNECT_TIMEOUT_S) -> None:
    """A TCP connection to one of Modal's API hosts: Modal's client would retry for a minute instead."""
    urls = [urlsplit(url.strip()) for url in _modal_config().get("server_url").split(",")]  # primary, fallbacks
    hosts = [(url.hostname, url.port or (443 if url.scheme == "https" else 80)) for url in urls]
    answers: queue.Queue[str | None] = queue.Queue()  # None: connected; else why not

    def connect(host: str, port: int) -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answers.put(None)
        except OSError as e:
            answers.put(f"{host}:{port}: {e}")

    # name resolution has no timeout of its own: daemon threads, and stop waiting for them instead
    for host, port in hosts:
        threading.Thread(target=connect, args=(host, port), daemon=True).start()
    deadline = time.monotonic() + timeout
    failures: list[str] = []
    while len(failures) < len(hosts):
        try:
            failure = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            failures.append(f"no answer in {timeout:g} s")
            break
        if failure is None:
            return
        failures.append(failure)
    raise ModalUnavailable(f"cannot reach Modal ({'; '.join(failures)}): check the network")


def preflight(gpu: str) -> str:
    """Every check, cheapest first; returns the GPU type as Modal spells it."""
    gpu = check_gpu(gpu)
    check_credentials()
    check_reachable()
    return gpu
