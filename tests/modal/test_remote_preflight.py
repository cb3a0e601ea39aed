"""Bad input and a missing Modal fail here, plainly and within seconds, before any Modal call."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weft.remote.preflight import GPU_TYPES, ModalUnavailable, check_gpu, check_reachable

ROOT = Path(__file__).resolve().parents[2]
pytest_plugins = ["pytester"]


def without_credentials(tmp_path: Path) -> dict[str, str]:
    """This environment with no Modal token anywhere: none in the environment, no ~/.modal.toml."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    return env | {"HOME": str(tmp_path), "MODAL_CONFIG_PATH": str(tmp_path / ".modal.toml")}


def test_gpu_types_are_modals_names_in_any_case():
    assert check_gpu("l40s") == "L40S"
    assert check_gpu("H100") == "H100"
    with pytest.raises(ModalUnavailable, match="unknown Modal GPU type 'X100': choose from T4, L4") as e:
        check_gpu("X100")
    assert all(name in str(e.value) for name in GPU_TYPES)


def test_main_modal_without_credentials_says_so_within_seconds(tmp_path):
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "main.py", "--modal"], cwd=ROOT, env=without_credentials(tmp_path), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    took = time.perf_counter() - started
    assert done.returncode == 1, done.stderr
    assert "no Modal credentials: run `uv run modal token new`" in done.stderr
    assert "Traceback" not in done.stderr
    assert took < 10, f"{took:.1f} s"


def test_main_rejects_unknown_gpu_and_experiment(tmp_path, capsys):
    import main

    assert main.main(["--modal", "--modal-gpu", "V100"]) == 1
    assert "unknown Modal GPU type 'V100'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main.main(["--collect", "e1", "e99"])
    assert exit_.value.code == 2
    assert "invalid choice: 'e99' (choose from 'all', 'e1'," in capsys.readouterr().err


def test_pytest_modal_without_credentials_is_a_usage_error(pytester, monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_ID", "")  # set and empty: wins over any ~/.modal.toml
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "")
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest("-p", "weft.remote.pytest_plugin", "--modal")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: no Modal credentials*"])


def test_unreachable_api_host_fails_fast(monkeypatch):
    monkeypatch.setenv("MODAL_SERVER_URL", "https://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(ModalUnavailable, match=r"cannot reach Modal \(127\.0\.0\.1:9: .*refused.*\)"):
        check_reachable()


def test_a_reachable_fallback_host_is_enough(monkeypatch):
    """Modal's client races the hosts its setting lists; so does the check."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        monkeypatch.setenv("MODAL_SERVER_URL", f"https://127.0.0.1:9,https://127.0.0.1:{port}")
        check_reachable()


def test_silent_api_host_fails_after_the_timeout(monkeypatch):
    """A host that never answers (or a name that never resolves) costs the timeout, no more."""

    def hang(*args, **kwargs):
        time.sleep(2)
        raise OSError("answered too late")

    monkeypatch.setattr(socket, "create_connection", hang)
    started = time.perf_counter()
    with pytest.raises(ModalUnavailable, match=r"no answer in 0\.2 s"):
        check_reachable(timeout=0.2)
    assert time.perf_counter() - started < 1
