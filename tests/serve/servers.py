"""Servers for the live tests: `weft serve` as a user starts it (a subprocess on 127.0.0.1), and one
whose app runs in this process (its engine process still its own), so a test can reach into it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI

from weft.inference.config import EngineConfig
from weft.serve.api_server import build_app
from weft.serve.async_engine import AsyncEngine

START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live(proc: subprocess.Popen, port: int) -> Iterator[str]:
    """A server process listening on 127.0.0.1:`port` -> its base URL (…/v1), once /health says 200;
    terminated on exit."""
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def child_env() -> dict[str, str]:
    """This process's environment, its PYTHONPATH made absolute (a checkout run as `PYTHONPATH=.`)."""
    path = os.pathsep.join(os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    return {**os.environ, "PYTHONPATH": path}


@contextmanager
def weft_server(*args: str) -> Iterator[str]:
    """`python -m weft serve ARGS` on a free port -> its base URL (…/v1)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weft", "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
    )  # fmt: skip
    with live(proc, port) as url:
        yield url


def wait_healthy(url: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"no healthy server at {url} after {START_TIMEOUT_S} s")


@contextmanager
def in_process_server(config: EngineConfig, name: str, max_queued_requests: int | None = None,
                      **app_options: object) -> Iterator[tuple[str, FastAPI]]:
    """build_app (with `app_options`: api_key, ...) over an engine process for `config`, under uvicorn in a thread
    of this process -> (its base URL …/v1, the app: `app.state.engine` is the AsyncEngine)."""
    port = free_port()
    app = build_app(AsyncEngine(config, max_queued_requests), name, **app_options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}/v1", app
    finally:
        server.should_exit = True
        thread.join(30)
