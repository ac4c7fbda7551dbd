"""A real SLURM cluster for the session: munged, slurmctld and two slurmd daemons as two nodes, on localhost.

Started once (about a second) when a test asks for it, shut down at the end whatever happened. Skipped, with the
reason, only where SLURM is not installed and cannot be (no root or no apt-get); CI installs it in `.ci/run`.
"""

from __future__ import annotations

import os

import pytest

from hybridtron.slurm.cluster import SBIN_PATH, LocalCluster, unavailable_reason


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = unavailable_reason(install=True, log=lambda msg: print(f"[slurm fixture] {msg}", flush=True))
    if reason:
        pytest.skip(f"no local SLURM cluster: {reason}")
    cluster = LocalCluster(tmp_path_factory.mktemp("slurm"), n_nodes=2, cpus_per_node=1)
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PATH")}
    try:
        cluster.start()
        # `hybridtron submit` (in this process) and the jobs (which inherit its environment) use this cluster
        os.environ["SLURM_CONF"] = str(cluster.conf)
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + SBIN_PATH
        yield cluster
    finally:
        cluster.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
