"""Several JAX processes on one machine, joined into one mesh: for tests, and for trying the
multi-process engine (``hybridattn.engine.processes``) before a cluster.

``start`` runs ``N`` copies of a Python program, each told by its environment who it is
(``HYBRIDATTN_PROCESS_ID``), how many there are, where the coordinator listens (a free port
on 127.0.0.1) and how many CPU devices it has; the program calls ``initialize()`` first,
which configures JAX for that (``jax_num_cpu_devices``, gloo CPU collectives) and joins the
group (``jax.distributed.initialize``, with a short heartbeat timeout: a process that dies
ends the others with JAX's error naming it, within about ``heartbeat_seconds``, rather than
leaving them in a collective forever). On a cluster, call ``jax.distributed.initialize``
as its launcher says instead; nothing else changes.

From the command line::

    python -m hybridattn.launch --processes 2 --devices 4 -- my_program.py --its-flags

>>> env = environment(process_id=1, num_processes=2, port=1234, devices=4)
>>> env["HYBRIDATTN_COORDINATOR"], env["HYBRIDATTN_PROCESS_ID"]
('127.0.0.1:1234', '1')
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["environment", "initialize", "main", "start", "supervise"]

_PREFIX = "HYBRIDATTN_"


def environment(*, process_id: int, num_processes: int, port: int, devices: int,
                heartbeat_seconds: int = 10) -> dict[str, str]:
    """The variables ``initialize`` reads, for process ``process_id`` of ``num_processes``.

    >>> environment(process_id=0, num_processes=2, port=80, devices=1)["HYBRIDATTN_LOCAL_DEVICES"]
    '1'
    """
    return {f"{_PREFIX}COORDINATOR": f"127.0.0.1:{port}",
            f"{_PREFIX}PROCESS_ID": str(process_id),
            f"{_PREFIX}NUM_PROCESSES": str(num_processes),
            f"{_PREFIX}LOCAL_DEVICES": str(devices),
            f"{_PREFIX}HEARTBEAT_SECONDS": str(heartbeat_seconds)}


def start(argv: Sequence[str], *, processes: int, devices: int, heartbeat_seconds: int = 10,
          **popen) -> list[subprocess.Popen]:
    """Start ``processes`` copies of ``python argv...`` on this machine, each with ``devices``
    CPU devices, as one JAX process group (each must call ``initialize()`` first). Returns
    their ``Popen``\\ s; ``popen`` goes to each (``stdout=...``).

    >>> [p.wait() for p in start(["-c", "pass"], processes=2, devices=1)]
    [0, 0]
    >>> start(["-c", "pass"], processes=0, devices=1)
    Traceback (most recent call last):
    ...
    ValueError: processes=0 and devices=1 must be at least 1
    """
    if processes < 1 or devices < 1:
        raise ValueError(f"processes={processes} and devices={devices} must be at least 1")
    with socket.socket() as s:  # a free port for the coordinator (process 0 binds it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **popen.pop("env", {})}
    # each in a session of its own: a terminal's Ctrl-C reaches the launcher alone, which
    # passes it on once (``supervise``), instead of every process getting it twice
    popen.setdefault("start_new_session", True)
    return [subprocess.Popen([sys.executable, *argv], env={**env, **environment(
        process_id=k, num_processes=processes, port=port, devices=devices,
        heartbeat_seconds=heartbeat_seconds)}, **popen) for k in range(processes)]


def initialize() -> bool:
    """In a process ``start`` began: give JAX its CPU devices and gloo collectives and join the
    group; False (nothing done) in a process that was not started so. Call it before any
    other JAX call.

    >>> initialize()  # (this process was not started by ``start``)
    False
    """
    if f"{_PREFIX}COORDINATOR" not in os.environ:
        return False
    import jax

    env = os.environ
    jax.config.update("jax_num_cpu_devices", int(env[f"{_PREFIX}LOCAL_DEVICES"]))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=env[f"{_PREFIX}COORDINATOR"],
        num_processes=int(env[f"{_PREFIX}NUM_PROCESSES"]),
        process_id=int(env[f"{_PREFIX}PROCESS_ID"]),
        heartbeat_timeout_seconds=int(env[f"{_PREFIX}HEARTBEAT_SECONDS"]))
    return True


def supervise(procs: Sequence[subprocess.Popen], grace_seconds: float = 10.0) -> int:
    """Wait for ``procs``; the first non-zero exit code of theirs (0 if none). A SIGTERM or
    SIGINT to this process is forwarded to each of them, and those still running
    ``grace_seconds`` later are killed, so that stopping the launcher stops its processes
    (and reaps them); the code is then ``128 + signal``, as a shell reports it. Call it from
    the main thread (signal handlers live there).

    >>> supervise(start(["-c", "import sys; sys.exit(3)"], processes=2, devices=1))
    3
    """
    caught: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if not caught:
            caught.append(signum)
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signum)

    kinds = (signal.SIGTERM, signal.SIGINT)
    before = {kind: signal.signal(kind, forward) for kind in kinds}
    try:
        deadline = None
        while any(proc.poll() is None for proc in procs):
            if caught and deadline is None:
                deadline = time.monotonic() + grace_seconds
            if deadline is not None and time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
            time.sleep(0.05)
    finally:
        for kind, handler in before.items():
            signal.signal(kind, handler)
    if caught:
        return 128 + caught[0]
    return next((proc.returncode for proc in procs if proc.returncode), 0)


def main(argv: list[str] | None = None) -> int:
    """``python -m hybridattn.launch``: start the processes, wait for them all
    (``supervise``: a SIGTERM or Ctrl-C is passed on to them); the exit code is the first
    non-zero one of theirs.

    >>> main(["--processes", "2", "--devices", "1", "--", "-c", "import sys; sys.exit(0)"])
    0
    """
    p = argparse.ArgumentParser(prog="python -m hybridattn.launch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices", type=int, default=4, help="CPU devices per process")
    p.add_argument("program", nargs=argparse.REMAINDER,
                   help="-- then the program and its arguments")
    args = p.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        p.error("give the program to run after --")
    return supervise(start(program, processes=args.processes, devices=args.devices))


if __name__ == "__main__":
    sys.exit(main())
