"""A real SLURM cluster on this one machine, for tests: ``munged``, ``slurmctld`` and one ``slurmd -N`` per node.

Each "node" is a slurmd of its own name listening on its own port on 127.0.0.1, so a two-node job really goes
through the controller, two node daemons, ``srun`` and the batch-script machinery that a cluster uses. Every
file (munge key and socket, ``slurm.conf``, state, spool, logs) lives under one directory; the clients reach
this cluster through ``SLURM_CONF`` (see ``env``), so nothing in ``/etc`` is read or changed.

What works inside a container without systemd or cgroup delegation: ``ProctrackType=proctrack/linuxproc``
(processes tracked by parentage), ``TaskPlugin=task/none``, no accounting database (``sacct`` is off; ``scontrol
show job`` still knows a finished job for ``MinJobAge`` seconds). Daemons run as root, as slurmd must to start
jobs. ``stop`` cancels the jobs and ends every process that carries this cluster's ``SLURM_CONF``, each by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Debian's packages (slurm-wlm, munge) put the daemons in /usr/sbin, which a non-login PATH may lack.
SBIN_PATH = os.pathsep.join(("/usr/sbin", "/sbin", "/usr/bin", "/bin"))
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
APT_PACKAGES = ("slurm-wlm", "munge")


def find_binary(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SBIN_PATH)


def missing_binaries() -> list[str]:
    return [b for b in (*DAEMONS, *CLIENTS) if find_binary(b) is None]


def install_slurm(log=print) -> str | None:
    """Install Debian's slurm-wlm and munge when a binary is missing; None when they are there, else the reason
    they are not (no root, no apt-get, or apt-get's own error)."""
    if not missing_binaries():
        return None
    need = ", ".join(missing_binaries())
    if os.geteuid() != 0:
        return f"SLURM is not installed ({need} missing) and installing it needs root: apt-get install slurm-wlm munge"
    if shutil.which("apt-get") is None:
        return f"SLURM is not installed ({need} missing) and there is no apt-get here to install slurm-wlm and munge"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log(f"installing {' '.join(APT_PACKAGES)} with apt-get ({need} missing)")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]):
        try:
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{' '.join(cmd)} failed: {e}"
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
            return f"{' '.join(cmd)} failed (exit {res.returncode}): {' / '.join(tail)}"
    left = missing_binaries()
    return f"apt-get installed {' '.join(APT_PACKAGES)} but {', '.join(left)} are still missing" if left else None


def unavailable_reason(install: bool = True, log=print) -> str | None:
    """Why a local cluster cannot run here (None: it can), after installing SLURM when allowed and possible."""
    if not sys.platform.startswith("linux"):
        return f"the local SLURM cluster needs Linux (this is {sys.platform})"
    reason = install_slurm(log) if install else (
        f"SLURM is not installed ({', '.join(missing_binaries())} missing)" if missing_binaries() else None)
    if reason:
        return reason
    if os.geteuid() != 0:
        return "the local SLURM cluster runs slurmd, which must be root to start jobs; run these tests as root"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClusterError(RuntimeError):
    """A daemon did not come up; the message names it and the tail of its log."""


@dataclass
class Node:
    name: str
    port: int


class LocalCluster:
    """``with LocalCluster(tmp_dir, n_nodes=2) as c: subprocess.run(["sbatch", ...], env=c.env(os.environ))``."""

    def __init__(self, root: Path, n_nodes: int = 2, cpus_per_node: int = 1, partition: str = "debug",
                 kill_wait: int = 30, cred_expire: int = 10):
        self.root = Path(root).resolve()
        self.partition = partition
        self.cpus_per_node = cpus_per_node
        self.kill_wait = kill_wait
        self.cred_expire = cred_expire
        self.nodes = [Node(f"node{i + 1}", 0) for i in range(n_nodes)]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._procs: list[tuple[str, subprocess.Popen]] = []

    # ---- environment for clients ----------------------------------------------------------------
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + SBIN_PATH
        return env

    def run(self, *cmd: str, check: bool = False, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, check=check,
                              timeout=timeout)

    # ---- start ----------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> LocalCluster:
        for sub in ("munge", "state", "log", *(f"spool/{n.name}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o755)  # clients connect to the socket inside
        try:
            self._start_munge(timeout)
            self._write_conf()
            self._spawn("slurmctld", [find_binary("slurmctld"), "-D", "-f", str(self.conf)])
            self._wait(lambda: self.run("scontrol", "ping").stdout.count("UP") > 0, timeout, "slurmctld",
                       self.root / "log" / "slurmctld.log")
            for node in self.nodes:
                self._spawn(f"slurmd {node.name}", [find_binary("slurmd"), "-D", "-N", node.name, "-f", str(self.conf)])
            self._wait(self._all_idle, timeout, "slurmd", self.root / "log" / f"slurmd.{self.nodes[-1].name}.log")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self, timeout: float) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        log = self.root / "log" / "munged.log"
        # --force: munged refuses a few things root may do (a key outside /etc/munge); here that is deliberate.
        self._spawn("munged", [find_binary("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                               f"--log-file={log}", f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        self._wait(self.munge_socket.exists, timeout, "munged", log)

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        ctld_port = free_port()
        for node in self.nodes:
            node.port = free_port()
        r = self.root
        lines = [
            "# A local test cluster written by hybridtron.slurm.cluster; every path is under this directory.",
            "ClusterName=hybridtron-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also holds a requeued job back (120 s by default, so that no node still holds the old
            # credential); 10 s keeps a requeue test short and still past the slurmd cleanup it waits for
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.%n.log'}",
            # no cgroups in a container: processes tracked by parentage, tasks not bound
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/builtin",  # a job starts when it is submitted if nodes are free
            "SchedulerParameters=sched_interval=2",  # and a requeued one soon after its hold (every 60 s by default)
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",  # every slurmd sees the whole machine; the config says one node's share
            "ReturnToService=2",
            "JobRequeue=1",
            f"KillWait={self.kill_wait}",
            "MinJobAge=600",  # scontrol show job knows a finished job for 10 minutes (there is no sacct)
            "InactiveLimit=0",
            "SlurmdTimeout=120",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node.name} NodeHostname={host} NodeAddr=127.0.0.1 Port={node.port} "
                         f"CPUs={self.cpus_per_node} RealMemory=1024 State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes={','.join(n.name for n in self.nodes)} Default=YES "
                     f"MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name.replace(' ', '.')}.console", "ab")  # noqa: SIM115 (closed in stop)
        proc = subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        self._procs.append((name, proc))

    def _wait(self, ready, timeout: float, what: str, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise ClusterError(f"{name} exited with {proc.returncode} while starting; "
                                       f"{self._tail(log)}")
            try:
                if ready():
                    return
            except (OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.2)
        raise ClusterError(f"{what} did not come up within {timeout:.0f} s; {self._tail(log)}")

    @staticmethod
    def _tail(log: Path) -> str:
        try:
            lines = log.read_text(errors="replace").strip().splitlines()[-5:]
        except OSError:
            return f"no log at {log}"
        return f"last lines of {log}: " + " / ".join(lines)

    def _all_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return all(states.get(n.name) == "idle" for n in self.nodes)

    # ---- helpers for tests ----------------------------------------------------------------------
    def job_field(self, job_id: str, field: str) -> str | None:
        """One field of ``scontrol show job`` (JobState, Restarts, Reason, ...); None if the job is unknown."""
        res = self.run("scontrol", "show", "job", "-o", str(job_id))
        for item in res.stdout.split():
            if item.startswith(f"{field}="):
                return item.split("=", 1)[1]
        return None

    # ---- stop -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, stop the daemons, then end any process left that carries this cluster's SLURM_CONF
        (job steps, slurmstepd, slurmscriptd), each by its pid."""
        if self.conf.exists() and any(p.poll() is None for _, p in self._procs):
            try:
                jobs = self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split()
                if jobs:
                    self.run("scancel", *jobs, timeout=10)
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.strip():
                        time.sleep(0.3)
            except (OSError, subprocess.SubprocessError):
                pass
        for _name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for _name, proc in reversed(self._procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._procs.clear()
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def leftover_pids(self) -> list[int]:
        """What this cluster started and left: processes whose environment names its slurm.conf and that are a job's
        (SLURM_JOB_ID) or SLURM's own (slurmstepd, slurmscriptd); never this process nor its ancestors."""
        mine = f"SLURM_CONF={self.conf}".encode()
        skip, pid = set(), os.getpid()
        while pid > 1:  # this process and its ancestors carry the variable when a test set it
            skip.add(pid)
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        out = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) in skip:
                continue
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
                if mine not in env:
                    continue
                if any(e.startswith(b"SLURM_JOB_ID=") for e in env) or \
                        Path(os.readlink(proc / "exe")).name.startswith("slurm"):
                    out.append(int(proc.name))
            except OSError:
                continue
        return out

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
