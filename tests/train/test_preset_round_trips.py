"""Every tiny preset, end to end: train a few steps, `hybridtron export`, load the directory in transformers (native
class or our custom code), compare its logits with the model `sample` loads and its greedy text with `hybridtron
sample`'s, import it back the way `train --init-from hf:DIR` does, and re-export it bit for bit. The classes are
those the export table of docs/export.md names."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hybridtron.cli import main
from hybridtron.configs import load_config
from hybridtron.data_pipeline import load_tokenizer
from hybridtron.model import GatedLM
from hybridtron.train.build import load_for_inference

transformers = pytest.importorskip("transformers", reason="transformers is a dependency; install the project")

# preset -> the transformers class its export is (docs/export.md)
PRESETS = {
    "tiny": "Qwen3_5ForCausalLM",
    "tiny_hybrid": "Qwen3_5ForCausalLM",
    "tiny_scale": "Qwen3_5ForCausalLM",
    "tiny_structured": "Qwen3_5ForCausalLM",
    "tiny_moe": "HybridtronForCausalLM",  # the auxiliary-loss-free router bias
    "tiny_deltaproduct": "HybridtronForCausalLM",  # negative eigenvalues, DeltaProduct
    "tiny_hax": "HybridtronForCausalLM",  # HAX sparse attention in every Gated DeltaNet mixer, no attention layer
}
SHORT = ["--model.n_layers", "4", "--train.max_steps", "2", "--checkpoint.every", "2", "--train.eval_every", "0",
         "--train.warmup_steps", "1"]
PROMPT = "def main():"


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_trains_exports_loads_samples_and_round_trips(preset, small_data_dir, cli_args, tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "hf"
    argv = cli_args(small_data_dir, run, SHORT)
    argv[argv.index("--config") + 1] = preset
    assert main(argv) == 0
    assert main(["export", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    cls = PRESETS[preset]
    custom = cls == "HybridtronForCausalLM"
    assert f"({cls})" in printed and ("custom code: transformers has no class for" in printed) == custom, printed
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls]

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=custom).eval()
    assert type(hf).__name__ == cls
    ckpt = run / "checkpoints" / "step_00000002"
    cfg, model, tok, _dev = load_for_inference(ckpt, [("train.device", "cpu")])
    x = torch.randint(0, cfg.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(x).logits - model.float().eval()(x)).abs().max().item() <= 1e-4

    # greedy text: `hybridtron sample` (EOS, then the prompt) against transformers' generate from the same ids
    assert main(["sample", "--checkpoint", str(ckpt), "--prompt", PROMPT, "--temperature", "0",
                 "--max-new-tokens", "16"]) == 0
    ours = capsys.readouterr().out.rstrip("\n")
    ids = [tok.eos_id] + tok.encode(PROMPT)
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                         eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)[0].tolist()
    assert ours == tok.decode(theirs[1:])
    assert len(theirs) > len(ids)

    # import back (what `train --init-from hf:DIR` builds and loads), then export again: the same bytes' tensors
    from hybridtron.train.hf.export import export_model
    from hybridtron.train.hf.load import apply_init_from, load_hf_weights

    again = load_config(str(ckpt / "config.yaml"))  # the run's settings; the model section comes from the directory
    apply_init_from(again, f"hf:{out}")
    imported = GatedLM(again.model, again.model.vocab_size)
    load_hf_weights(imported, out)
    export_model(imported.eval(), ckpt / "tokenizer", tmp_path / "again", log=lambda _: None)
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((tmp_path / "again" / "config.json").read_text())
    assert load_tokenizer(ckpt / "tokenizer").encode(PROMPT) == \
        transformers.AutoTokenizer.from_pretrained(out)(PROMPT, add_special_tokens=False)["input_ids"]
