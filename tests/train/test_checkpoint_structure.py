"""One way to load a checkpoint (train/build.py): resume, sample, eval and export rebuild a self-guided
structured-FFN model for a checkpoint exactly as it was saved, at the guide's boundaries: mid-guide (dense
guide mixed in), the guide's last step (the guide still in the files, its weight 0 from the next step on)
and the step after (the guide gone). A run extended to more steps (a later end of the guide) resumes too."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridtron.cli import main
from hybridtron.configs import load_config
from hybridtron.model import GatedLM
from hybridtron.model.structured_ffn import StructuredLinear
from hybridtron.train.build import load_for_inference, saved_guide

# max_steps 6, fraction 0.5: the guide fades over steps 0..2 and leaves the model before step 3's forward.
GUIDED = ["--model.ffn.kind", "blockdense", "--model.ffn.rank", "16", "--model.ffn.n_blocks", "4",
          "--model.ffn.self_guided", "true", "--model.ffn.self_guided_fraction", "0.5",
          "--train.eval_every", "0", "--train.warmup_steps", "1", "--checkpoint.keep_last", "10"]


def train(cli_args, data_dir, run, steps, every=1):
    argv = cli_args(data_dir, run, GUIDED + ["--train.max_steps", str(steps), "--checkpoint.every", str(every)])
    assert main(argv) == 0


@pytest.fixture(scope="module")
def guided_run(small_data_dir, small_argv, tmp_path_factory):
    run = tmp_path_factory.mktemp("guided") / "run"
    train(small_argv, small_data_dir, run, 6)
    return run


def reference_logits(ckpt: Path, alpha: float, x: torch.Tensor) -> torch.Tensor:
    """The checkpoint's weights in a model built here, the guide mixed in by hand with weight ``alpha``."""
    cfg = load_config(str(ckpt / "config.yaml"))
    model = GatedLM(cfg.model, cfg.model.vocab_size)
    saved = load_file(str(ckpt / "model.safetensors"))
    mods = {n: m for n, m in model.named_modules() if isinstance(m, StructuredLinear) and hasattr(m, "dense")}
    for name, m in mods.items():
        if f"{name}.dense" not in saved:
            del m.dense
    model.load_state_dict(saved, strict=True)
    for m in mods.values():
        m.alpha = alpha
    return model.eval()(x)


@pytest.mark.slow
@pytest.mark.parametrize("step, guide, alpha", [(2, True, 0.25), (3, True, 0.0), (4, False, 0.0)])
def test_every_checkpoint_at_the_guides_boundaries_loads_everywhere(guided_run, step, guide, alpha, small_data_dir,
                                                                     cli_args, tmp_path, capsys):
    ckpt = guided_run / "checkpoints" / f"step_{step:08d}"
    assert saved_guide(ckpt) is guide
    assert any(k.endswith(".dense") for k in load_file(str(ckpt / "model.safetensors"))) is guide

    # sample / eval's model: the mix weight of training's next step (cos schedule: 0.25 at 2 of 3 steps)
    assert math.isclose(0.5 * (1 + math.cos(math.pi * 2 / 3)), 0.25)
    _cfg, model, _tok, _dev = load_for_inference(ckpt, [("train.device", "cpu")])
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(x)
        assert (ours - reference_logits(ckpt, alpha, x)).abs().max().item() <= 1e-5
        if guide and alpha:  # the guide matters here: weight 1.0 (the old default) is another model
            assert (ours - reference_logits(ckpt, 1.0, x)).abs().max().item() > 1e-2

    assert main(["sample", "--checkpoint", str(ckpt), "--prompt", "def", "--max-new-tokens", "4"]) == 0
    assert main(["eval", "--checkpoint", str(ckpt), "--batches", "1"]) == 0
    capsys.readouterr()

    # export: the same model (its own check holds it to 1e-4), and transformers agrees with sample's model
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(x).logits - ours).abs().max().item() <= 1e-4

    # resume from this checkpoint to the end: bit for bit the uninterrupted run's last checkpoint
    run = tmp_path / "run"
    shutil.copytree(guided_run, run)
    for later in (run / "checkpoints").glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (run / "checkpoints" / "latest").write_text(f"step_{step:08d}")
    train(cli_args, small_data_dir, run, 6)
    a = load_file(str(guided_run / "checkpoints" / "step_00000006" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_00000006" / "model.safetensors"))
    assert a.keys() == b.keys() and not any(k.endswith(".dense") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_a_self_guided_run_extended_to_more_steps_resumes(small_data_dir, cli_args, tmp_path, capsys):
    """4 steps (the guide leaves at step 2), then the same run to 12 (the guide would now fade until step 6):
    the dropped guide stays dropped, and sample and export load the extended run's checkpoints."""
    run = tmp_path / "run"
    train(cli_args, small_data_dir, run, 4, every=2)
    assert saved_guide(run / "checkpoints" / "step_00000004") is False
    train(cli_args, small_data_dir, run, 12, every=2)
    for step in (6, 12):
        assert saved_guide(run / "checkpoints" / f"step_{step:08d}") is False
    assert main(["sample", "--run-dir", str(run), "--prompt", "def", "--max-new-tokens", "4"]) == 0
    pytest.importorskip("transformers")
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
