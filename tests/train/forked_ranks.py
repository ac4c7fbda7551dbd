"""The ranks of a multi-process run as forks of one warm interpreter (the layout tests' launcher).

torchrun starts each rank as a fresh interpreter, and one more for itself: about 6 s of CPU per rank importing
torch and the trainer, and 3.5 s for the launcher, before any step (measured on the 2-core CI machine, where a
4-step run of the small model then trains in about 2 s). The layout tests (data, tensor, pipeline, context and
expert parallel) start tens of such runs only to compare each layout's maths with one process, for which the
launcher plays no part. They start their ranks here instead: a server process imports the trainer once, never runs
a torch op (so it has no threads and forks safely), and for each run forks one child per rank with the environment
torchrun gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which runs
`hybridtron.cli.main` on the run's argv as `torchrun -m hybridtron.cli` would. As torchrun does, the first rank to
fail brings the others down (SIGTERM, then SIGKILL), and the run's exit code is that rank's.

What torchrun itself does (its rendezvous, error files, restarts, signals, orphan watch) is tested with torchrun in
the files that test it (test_launcher_watch, test_hang_watch, test_run_lock, test_data_parallel's kill tests).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_server: subprocess.Popen | None = None
_lock = threading.Lock()


def run(argv: list[str], nproc: int, env: dict[str, str] | None = None, timeout: float = 300
        ) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m hybridtron.cli *argv`` by forks of the warm server: a CompletedProcess
    whose stdout holds every rank's output (rank by rank) and whose returncode is the first failed rank's."""
    global _server
    with _lock:
        if _server is None or _server.poll() is not None:
            senv = {**os.environ, "OMP_NUM_THREADS": "1"}
            _server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=senv, text=True, bufsize=1)
            atexit.register(_server.kill)
        request = {"argv": list(argv), "nproc": nproc, "timeout": timeout,
                   "env": {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}}
        _server.stdin.write(json.dumps(request) + "\n")
        _server.stdin.flush()
        line = _server.stdout.readline()
    if not line:
        raise RuntimeError(f"the forked-ranks server died (exit {_server.poll()})")
    reply = json.loads(line)
    res = subprocess.CompletedProcess(["forked_ranks", *argv], reply["returncode"], reply["output"], "")
    res.cpu_s = reply["cpu_s"]  # the ranks' CPU seconds (user + system)
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(argv: list[str], env: dict, rank: int, nproc: int, port: int, log: str) -> None:
    """In the forked child: become rank ``rank`` and run the command; never returns."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(nproc),
                          LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch

        torch.set_num_threads(1)
        from hybridtron.cli import main

        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the traceback goes to the rank's output, the code to the launcher
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code if isinstance(code, int) else 1)


def _launch(request: dict) -> dict:
    argv, nproc, env = request["argv"], request["nproc"], request["env"]
    port = _free_port()
    logs = [tempfile.mkstemp(prefix=f"rank{r}-", suffix=".log")[1] for r in range(nproc)]
    sys.stdout.flush()
    pids = {}
    for r in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(argv, env, r, nproc, port, logs[r])
        pids[pid] = r
    codes: dict[int, int] = {}
    first_failed = None
    deadline = time.monotonic() + request["timeout"]
    stop_at = None
    cpu = 0.0
    while len(codes) < nproc:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if first_failed is None and now > deadline:
                first_failed = -1
                stop_at = now
                for p in pids:
                    if pids[p] not in codes:
                        os.kill(p, signal.SIGKILL)
            elif stop_at is not None and now > stop_at + 10:
                for p in pids:
                    if pids[p] not in codes:
                        os.kill(p, signal.SIGKILL)
            time.sleep(0.05)
            continue
        r = pids[pid]
        codes[r] = os.waitstatus_to_exitcode(status)
        cpu += usage.ru_utime + usage.ru_stime
        if codes[r] != 0 and first_failed is None:
            first_failed, stop_at = r, time.monotonic()
            for p, other in pids.items():  # as torchrun: the others are stopped
                if other not in codes:
                    os.kill(p, signal.SIGTERM)
    output = []
    for log in logs:
        output.append(Path(log).read_text(errors="replace"))
        os.unlink(log)
    if first_failed == -1:
        returncode = -signal.SIGKILL
        output.append(f"forked_ranks: the run passed its {request['timeout']} s and was killed\n")
    else:
        returncode = 0 if first_failed is None else codes[first_failed]
    return {"returncode": returncode, "output": "".join(output), "cpu_s": cpu}


def serve() -> None:
    """Import the trainer once, then launch each request read from stdin; the replies go to stdout, a line each."""
    import torch  # noqa: F401 - the import the forks share

    import hybridtron.cli  # noqa: F401
    import hybridtron.train.trainer  # noqa: F401

    for line in sys.stdin:
        reply = _launch(json.loads(line))
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
