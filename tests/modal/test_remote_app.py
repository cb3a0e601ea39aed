"""The Modal app, its image and its functions are defined without contacting Modal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter whose sockets refuse to connect: any network call would fail.
DEFINE_OFFLINE = """
import socket

def refuse(*args, **kwargs):
    raise AssertionError(f"network call: {args}")

socket.socket.connect = socket.create_connection = refuse
import modal
from weft.remote import app

assert app.app.name == "weft"
for function in (app.gate, app.collect, app.run_node):
    assert isinstance(function, modal.Function)
    assert isinstance(function.with_options(gpu="L40S"), modal.Function)
print("defined")
"""


def test_app_is_defined_offline():
    done = subprocess.run([sys.executable, "-c", DEFINE_OFFLINE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "defined"
