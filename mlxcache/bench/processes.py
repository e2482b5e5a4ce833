"""HTTP servers as real subprocesses on 127.0.0.1: a free port, start, wait for ``/health``,
stop. The server benchmark runs ``mlxcache.serve`` and ``mlx_lm.server`` through these.

>>> 1024 <= free_port() < 65536
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

__all__ = ["Launched", "anchor_command", "free_port", "launch", "ours_command"]

_ROOT = pathlib.Path(__file__).resolve().parents[2]  # the directory holding ``mlxcache``


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_command(model_dir: str, port: int, name: str) -> list[str]:
    """``python -m mlxcache.serve`` on ``model_dir``, serving it as ``name``."""
    return [sys.executable, "-m", "mlxcache.serve", "--model", model_dir, "--host",
            "127.0.0.1", "--port", str(port), "--served-model-name", name,
            "--log-level", "warning"]


def anchor_command(model_dir: str, port: int) -> list[str]:
    """``mlx_lm.server`` on ``model_dir`` with its defaults (it serves the directory under
    the model name ``default_model``)."""
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--host",
            "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]


@dataclasses.dataclass(frozen=True)
class Launched:
    """A running server: its base ``url`` (``http://127.0.0.1:PORT``), the ``model`` name
    requests send, its log file."""

    url: str
    model: str
    log: pathlib.Path
    process: subprocess.Popen


def _log_tail(log: pathlib.Path, chars: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _wait_healthy(url: str, proc: subprocess.Popen, log: pathlib.Path,
                  timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(proc.args)} exited with {proc.returncode}:\n"
                               f"{_log_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{' '.join(proc.args)} not healthy after {timeout:.0f} s:\n"
                       f"{_log_tail(log)}")


@contextlib.contextmanager
def launch(argv: list[str], port: int, model: str, log: pathlib.Path,
           timeout: float = 180.0) -> Iterator[Launched]:
    """Start ``argv`` (a server listening on ``port``), its output into ``log``; yield it
    once ``GET /health`` answers 200 (``RuntimeError`` with the log's tail if it exits or
    is not healthy within ``timeout`` seconds); terminate it at the end."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, timeout)
        yield Launched(url, model, log, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
