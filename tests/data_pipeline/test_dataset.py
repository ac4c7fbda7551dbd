from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridtron.configs.job import SourceConfig, TokenizerConfig
from hybridtron.data_pipeline import build_dataset, prepare_data
from hybridtron.data_pipeline.dataset import BlendedDataset, PackedDataset
from hybridtron.data_pipeline.shards import SplitReader, SplitWriter

from .conftest import quiet, stdlib_cfg
from .helpers import split_docs

EOS = 9


def _packed(tmp_path, docs, seq_len, shard_docs=2):
    w = SplitWriter(tmp_path / "s", np.uint16, "fp", "k", shard_docs=shard_docs)
    for d in docs:
        w.add(np.array(d + [EOS], dtype=np.uint16))
    w.finish()
    return PackedDataset(SplitReader(tmp_path / "s", "fp"), seq_len)


def test_packing_hand_built(tmp_path):
    # stream: 1 2 3 E | 4 5 E | 6 E | 7 7 7 7 E   (15 tokens)
    ds = _packed(tmp_path, [[1, 2, 3], [4, 5], [6], [7, 7, 7, 7]], seq_len=4)
    assert len(ds) == 3  # (15 - 1) // 4; the trailing partial sample is dropped
    s0, s1, s2 = ds[0], ds[1], ds[2]
    assert s0["input_ids"].tolist() == [1, 2, 3, EOS] and s0["labels"].tolist() == [2, 3, EOS, 4]
    assert s0["doc_ids"].tolist() == [0, 0, 0, 0]
    assert s1["input_ids"].tolist() == [4, 5, EOS, 6] and s1["labels"].tolist() == [5, EOS, 6, EOS]
    assert s1["doc_ids"].tolist() == [0, 0, 0, 1]
    assert s2["input_ids"].tolist() == [EOS, 7, 7, 7] and s2["labels"].tolist() == [7, 7, 7, 7]
    assert s2["doc_ids"].tolist() == [0, 1, 1, 1]
    assert s0["input_ids"].dtype == torch.long and s0["doc_ids"].dtype == torch.int32
    with pytest.raises(IndexError):
        ds[3]


def test_too_small_split_names_numbers(tmp_path):
    with pytest.raises(ValueError, match=r"holds 4 tokens .* seq_len\+1=9"):
        _packed(tmp_path, [[1, 2, 3]], seq_len=8)


def test_prepared_dataset_matches_shards(prepared_stdlib):
    cfg, prep = prepared_stdlib
    ds = build_dataset(cfg, "train")
    stream = np.concatenate(split_docs(prep.out_dir / "stdlib" / "train"))
    T = cfg.seq_len
    assert len(ds) == (len(stream) - 1) // T
    for i in (0, 1, len(ds) // 2, len(ds) - 1):
        s = ds[i]
        assert s["input_ids"].tolist() == stream[i * T : i * T + T].tolist()
        assert s["labels"].tolist() == stream[i * T + 1 : i * T + T + 1].tolist()
        # a new document id starts right after each EOS
        ends = (s["input_ids"] == prep.tokenizer.eos_id).int()
        expected = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(ends, 0)[:-1].int()])
        assert s["doc_ids"].tolist() == expected.tolist()


class _Const(torch.utils.data.Dataset):
    def __init__(self, tag, n):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return {"input_ids": torch.tensor([self.tag, i])}


def test_blend_proportions_and_wraparound():
    parts = [_Const(0, 50), _Const(1, 1000), _Const(2, 7)]
    weights = [0.2, 0.5, 0.3]
    b = BlendedDataset(parts, weights, size=5000)
    tags = np.array([b[i]["input_ids"][0].item() for i in range(len(b))])
    for j, w in enumerate(weights):
        assert abs((tags == j).mean() - w) < 0.002
        # every prefix stays within a couple of samples of its target share
        counts = np.cumsum(tags == j)
        assert np.max(np.abs(counts - w * np.arange(1, len(tags) + 1))) <= 2
    # the small sources wrap around: source 2 is asked for ~1500 samples but has 7
    idx2 = [b[i]["input_ids"][1].item() for i in range(len(b)) if tags[i] == 2]
    assert idx2[:9] == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_build_dataset_blends_two_sources(prepared_stdlib, tmp_path, tokenizer_json):
    ref_cfg, _ = prepared_stdlib
    a = tmp_path / "a.txt"
    a.write_text("alpha beta gamma\n" * 400)
    cfg = stdlib_cfg(
        tmp_path / "o",
        sources=[SourceConfig(path="stdlib", max_files=12, weight=3.0), SourceConfig(path=str(a), weight=1.0)],
        tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)),
    )
    prep = prepare_data(cfg, log=quiet)
    assert prep.sources == ["stdlib", "a"]
    ds = build_dataset(cfg, "train")
    single = build_dataset(ref_cfg, "train")
    assert isinstance(ds, BlendedDataset) and len(ds) == len(single) + len(ds.datasets[1])
    share = np.mean(ds.source == 0)
    assert abs(share - 0.75) < 0.01
    first_std = int(np.argmax(ds.source == 0))
    assert torch.equal(ds[first_std]["input_ids"], single[0]["input_ids"])


def test_blend_prefix_bound_many_sources():
    """Every prefix holds n*w_j of each source to within 1/2 + S*w_j/2, and each source is read in order."""
    from hybridtron.data_pipeline.dataset import blend_assignment

    rng = np.random.default_rng(3)
    for S in (2, 5, 9):
        w = rng.random(S) + 0.01
        w = w / w.sum()
        src, idx = blend_assignment(list(w), 20_000)
        assert len(src) == 20_000
        n = np.arange(1, 20_001)
        for j in range(S):
            dev = np.abs(np.cumsum(src == j) - w[j] * n)
            assert dev.max() <= 0.5 + S * w[j] / 2 + 1e-9
            assert np.array_equal(idx[src == j], np.arange((src == j).sum()))
