"""The oldest transformers pyproject allows, against the installed (newest) one: each, in a subprocess of its own,
loads a custom-code export (``trust_remote_code=True``) and a native Qwen3.5 export made by the current code,
with their tokenizers (stdin closed), and decodes greedily through its own cache; logits and tokens must agree.

The floor is installed with ``pip install --no-deps --target`` (cached under pytest's basetemp) next to the
installed huggingface_hub and tokenizers, whose versions must satisfy the floor's own requirements. Without
PyPI the test fails, naming pip's error: a floor nobody ran is not a floor."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from hybridtron.configs import DeltaNetConfig, ModelConfig
from hybridtron.model import GatedLM
from hybridtron.train.hf.export import export_model

ROOT = Path(__file__).resolve().parents[2]

# Run in each transformers: for every directory, the tokenizer's ids, full-forward logits and greedy decoding with
# the cache (the logits of each generated step); printed as JSON with the version and where it was imported from.
SCRIPT = r"""
import json, sys
sys.modules["fla"] = sys.modules["causal_conv1d"] = None  # transformers' torch paths on the CPU (train/hf/torch_paths.py)
import torch, transformers
out = {"version": transformers.__version__, "file": transformers.__file__, "dirs": {}}
for d in sys.argv[1:]:
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = tok("def f(x):\n    return x + 1", return_tensors="pt")["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        full = hf(ids).logits
        gen = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    out["dirs"][d] = {"class": type(hf).__name__, "ids": ids[0].tolist(), "full": full.tolist(),
                      "tokens": gen.sequences[0].tolist(), "steps": torch.cat(gen.logits).tolist()}
print("RESULT " + json.dumps(out))
"""


def floor() -> str:
    found = re.search(r'"transformers>=([0-9.]+)', (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml names no transformers floor (transformers>=X)"
    return found.group(1)


def dist_info(target: Path) -> Path | None:
    return next(target.glob("transformers-*.dist-info"), None)


def install(v: str, target: Path) -> Path:
    if dist_info(target) is None:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target),
                               f"transformers=={v}"], capture_output=True, text=True, timeout=600)
        if done.returncode:
            pytest.fail(f"pip could not install transformers=={v} (PyPI unreachable?): {done.stderr.strip()[-500:]}")
    return target


def check_requirements(v: str, target: Path) -> None:
    """The floor's own pins on huggingface_hub and tokenizers hold for the installed ones (else it fails to import)."""
    from packaging.requirements import Requirement

    meta = (dist_info(target) / "METADATA").read_text()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            req = Requirement(line.removeprefix("Requires-Dist:").strip())
            if req.name in ("huggingface-hub", "tokenizers"):
                have = version(req.name)
                assert req.specifier.contains(have, prereleases=True), (
                    f"transformers {v} needs {req}, installed is {have}: raise the floor in pyproject.toml")


def run(dirs: list[Path], first: Path | None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(first)] * (first is not None) + [env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, dirs)], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    return json.loads(said.split("RESULT ", 1)[1].splitlines()[0])


def model(cfg: ModelConfig) -> GatedLM:
    torch.manual_seed(0)
    m = GatedLM(cfg, 320)
    m.init_weights()
    return m.eval()


@pytest.mark.slow
def test_the_oldest_allowed_transformers_loads_and_decodes_like_the_newest(tok_dir, tmp_path, tmp_path_factory):
    v = floor()
    target = install(v, tmp_path_factory.getbasetemp() / f"transformers-{v}")
    check_requirements(v, target)

    small = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64, layer_pattern="LA",
                 init_std=0.2)  # logits far from uniform: greedy decoding is a real sequence, not one token
    dn = dict(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=8)
    custom = ModelConfig(**small, deltanet=DeltaNetConfig(**dn, neg_eigval=True, n_householder=2))
    native = ModelConfig(**small, deltanet=DeltaNetConfig(**dn))
    dirs = []
    for name, cfg, target_name in (("custom", custom, "hybridtron"), ("native", native, "qwen3_5_text")):
        report = export_model(model(cfg), tok_dir, tmp_path / name, log=lambda _: None)
        assert report.target == target_name
        dirs.append(tmp_path / name)

    newest, oldest = run(dirs, None), run(dirs, target)
    assert Version(oldest["version"]) == Version(v) and oldest["file"].startswith(str(target)), oldest["file"]
    assert newest["version"] == version("transformers")
    for d in map(str, dirs):
        a, b = newest["dirs"][d], oldest["dirs"][d]
        assert a["class"] == b["class"] and a["ids"] == b["ids"]
        assert a["tokens"] == b["tokens"] and len(set(a["tokens"][len(a["ids"]):])) > 1, (a["tokens"], b["tokens"])
        for key in ("full", "steps"):
            assert (torch.tensor(a[key]) - torch.tensor(b[key])).abs().max().item() <= 1e-5, (d, key)
