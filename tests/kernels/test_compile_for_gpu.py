"""Every Triton kernel compiles for an H100 (sm_90a) on this GPU-less machine, at the presets' widths, within the
shared memory a block may use; the chunked delta rule's dot products run on tensor cores.

The interpreter tests check what the kernels compute; they cannot see what only the GPU compiler checks
(a global that is not a constexpr, a tile that needs more shared memory than a block has) or what the dots
become. bench/compile_report.py compiles for the real target with triton's bundled ptxas and reads the cubins;
this test runs it in a process without TRITON_INTERPRET (this directory's conftest sets it for the others).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "hybridtron.bench.compile_report", "--arch", "90a", "--presets", "dense_1b",
           "hybrid_1b", "hybrid_moe", "--no-attention-variants", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = subprocess.run([sys.executable, "-c", "from hybridtron.bench.compile_report import project_kernels; "
                            "print(' '.join(sorted(project_kernels())))"], env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    return json.loads(out.read_text()), set(names)


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_within_shared_memory(compiled):
    kernels, every = compiled
    assert len(every) >= 20, every  # the discovery found the kernel modules
    seen = {k["name"] for k in kernels}
    assert seen == every, f"kernels a 1B preset's step never launched (not compiled): {sorted(every - seen)}"
    by_name: dict[str, list[dict]] = {}
    for k in kernels:
        by_name.setdefault(k["name"], []).append(k)
    # Autotuned kernels included: their tables hold only candidates that fit (pruned by compiling for sm_90a), so
    # the GPU's autotuner never spends a launch on one it must skip.
    for name, variants in by_name.items():
        over = [k for k in variants if k["over_shared"]]
        assert not over, (f"{name}: {len(over)} of {len(variants)} compiled configurations need up to "
                          f"{max(k['shared'] for k in over)} bytes of shared memory, over the 232448 an H100 block "
                          f"may use")


@pytest.mark.slow
def test_delta_rule_dots_run_on_tensor_cores(compiled):
    kernels, _ = compiled
    chunk = [k for k in kernels if k["name"] in ("_wy_fwd_kernel", "_state_fwd_kernel", "_output_fwd_kernel",
                                                 "_output_bwd_kernel", "_state_bwd_kernel", "_wy_bwd_kernel")]
    assert len({k["name"] for k in chunk}) == 6
    for k in chunk:
        assert k["ops"]["HGMMA"] > 0, f"{k['name']}: no warpgroup MMA: its dot products run on the CUDA cores"


@pytest.mark.slow
def test_no_kernel_of_the_presets_spills_on_sm90(compiled):
    """Spilled registers go to local memory (the stack): every kernel a preset launches keeps its stack at 0
    bytes on sm_90a."""
    kernels, _ = compiled
    for k in kernels:
        assert k["local"] == 0, (f"{k['name']} ({k['params']}) spills {k['local']} bytes on sm_90a "
                                 f"(bench/compile_report.py shows where)")
