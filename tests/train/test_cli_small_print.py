"""The users' small print (issue 39.4): each error names the flag that is wrong and only that one; a glob source's
data directory is named after what the glob names."""

from __future__ import annotations

import pytest

from hybridtron.cli import main
from hybridtron.configs import load_config
from hybridtron.data_pipeline.data_dir import default_data_dir


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


@pytest.mark.parametrize(("flags", "named", "unnamed"), [
    (["--nodes", "0"], ["--nodes 0"], ["--gpus-per-node 8"]),
    (["--gpus-per-node", "0"], ["--gpus-per-node 0"], ["--nodes 1"]),
    (["--nodes", "-1", "--gpus-per-node", "0"], ["--nodes -1 and --gpus-per-node 0"], []),
    (["--nodes", "0", "--suggest"], ["--nodes 0"], ["--gpus-per-node 8"]),
])
def test_plan_names_its_own_flags_for_an_empty_cluster(flags, named, unnamed, capsys):
    """It used to say the layout needs more processes than 'the launcher started (WORLD_SIZE)', and to change
    torchrun's --nproc-per-node: flags plan does not have."""
    assert main(["plan", *flags]) == 2
    err = _one_line(capsys)
    assert all(n in err for n in named) and "must be >= 1" in err, err
    assert not any(u in err for u in unnamed) and "WORLD_SIZE" not in err and "torchrun" not in err, err


@pytest.mark.parametrize(("flags", "said"), [
    (["--max-new-tokens", "-3"], "--max-new-tokens -3 must be >= 0"),  # used to name --top-k 50 too
    (["--top-k", "-1"], "--top-k -1 must be >= 0"),
    (["--top-k", "-1", "--max-new-tokens", "-2"], "--top-k -1 and --max-new-tokens -2 must be >= 0"),
])
def test_sample_names_only_the_bad_flags(flags, said, capsys, tmp_path):
    assert main(["sample", "--run-dir", str(tmp_path / "none"), *flags]) == 2
    err = _one_line(capsys)
    assert err == f"hybridtron sample: error: {said}", err


@pytest.mark.parametrize(("path", "name"), [
    ("corpus/*.jsonl", "corpus-bpe"),  # used to be source-bpe...
    ("data/corpus/**/*.jsonl", "corpus-bpe"),
    ("/mnt/corpus_*.jsonl", "corpus-bpe"),
    ("web/**/shard-*.jsonl.gz", "shard-bpe"),
    ("corpus/a.txt", "a-bpe"),  # no glob: as before
    ("stdlib", "stdlib-bpe"),
])
def test_a_glob_sources_data_directory_is_named_after_the_glob(path, name):
    cfg = load_config("tiny", [("data.sources", f"[{{path: '{path}'}}]")])
    assert default_data_dir(cfg.data).name.startswith(name), default_data_dir(cfg.data)
    named = load_config("tiny", [("data.sources", f"[{{path: '{path}', name: web}}]")])
    assert default_data_dir(named.data).name.startswith("web-bpe")  # a source's own name wins


def test_a_globs_directory_name_keeps_the_fingerprint():
    """Only the readable part changed: the fingerprint (what the directory holds) is the same as before, so the
    same corpus through another glob spelling that names the same files is still told apart by it."""
    a = default_data_dir(load_config("tiny", [("data.sources", "[{path: 'corpus/*.jsonl'}]")]).data)
    b = default_data_dir(load_config("tiny", [("data.sources", "[{path: 'corpus/*.json'}]")]).data)
    assert a.name.split("-")[0] == b.name.split("-")[0] == "corpus" and a != b


def test_a_cuda_device_this_machine_lacks_is_one_line(tmp_path, capsys):
    """train.device=cuda where torch sees no GPU was a RuntimeError, shown with its traceback."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["train", "--train.device", "cuda", "--run-dir", str(tmp_path / "run"),
                 "--data.out_dir", str(tmp_path / "data")]) == 2
    assert _one_line(capsys) == ("hybridtron train: error: train.device='cuda' but no CUDA device is visible; use "
                                 "train.device=cpu or auto")
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()
