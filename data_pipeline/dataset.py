"""Packed next-token samples over a split's shards, and the weighted blend of several sources."""

from __future__ import annotations

import numpy as np
import torch

from hybridtron.configs.job import DataConfig
from hybridtron.data_pipeline.data_dir import data_dir
from hybridtron.data_pipeline.errors import DataError
from hybridtron.data_pipeline.prepare import source_names
from hybridtron.data_pipeline.shards import ShardError, SplitReader
from hybridtron.data_pipeline.tokenizer import read_meta


class PackedDataset(torch.utils.data.Dataset):
    """The split's documents (each ending in EOS) as one token stream cut into samples of ``seq_len``.

    Sample i reads stream[i*T : i*T + T + 1]: input_ids = the first T, labels = the last T (the next sample
    starts with the previous one's last label). The trailing partial sample is dropped. ``doc_ids`` numbers
    the documents within the sample from 0, per input position; a document's EOS carries that document's id.
    """

    def __init__(self, reader: SplitReader, seq_len: int, name: str = ""):
        self.reader = reader
        self.seq_len = seq_len
        self.name = name or str(reader.dir)
        self.n_samples = max(0, (reader.n_tokens - 1) // seq_len)
        if self.n_samples == 0:
            if reader.n_docs == 0:
                # a one-document corpus: no val_fraction can put half a document in val
                advice = (
                    "the train/val split is per document (a text file is one, a jsonl line or parquet row one) and "
                    "none fell here: add documents, e.g. cut a large text file into several files or jsonl records, "
                    "and re-run `hybridtron prepare`"
                )
            else:
                advice = (
                    "lower data.seq_len or add data; the split is per document, so val grows with more documents "
                    "(or a larger data.val_fraction when there are many)"
                )
            raise DataError(
                f"{self.name} holds {reader.n_tokens} tokens in {reader.n_docs} documents, fewer than "
                f"seq_len+1={seq_len + 1} needed for one sample; {advice}"
            )

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n_samples:
            raise IndexError(f"sample {i} out of range for {self.name} with {self.n_samples} samples")
        T = self.seq_len
        start = i * T
        tok = torch.from_numpy(self.reader.tokens(start, start + T + 1).astype(np.int64))
        # index of the document holding each input position, relative to the first one in the sample
        pos = np.arange(start, start + T)
        doc = np.searchsorted(self.reader.doc_starts, pos, side="right") - 1
        doc_ids = torch.from_numpy((doc - doc[0]).astype(np.int32))
        return {"input_ids": tok[:-1], "labels": tok[1:], "doc_ids": doc_ids}


def blend_assignment(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, sample index within source) for each of ``size`` blended samples.

    Source j's k-th sample is due at the ideal position (k + 1/2) / w_j (Webster / Sainte-Lague order);
    the blend is all sources' due positions merged in order, ties to the lower source index. Every prefix
    of n samples then holds n * w_j of source j to within 1/2 + S * w_j / 2 samples (S sources). It is a
    sort, not a Python loop: a greedy loop over samples cost 7.8 us each (13 min for 100M samples).
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    # enough due positions per source to cover any prefix of `size`: n_j <= w_j * size + 1/2 + S/2
    per_source = np.ceil(w * size).astype(np.int64) + len(w) + 1
    src = np.repeat(np.arange(len(w), dtype=np.int64), per_source)
    idx = np.concatenate([np.arange(n, dtype=np.int64) for n in per_source])
    due = (idx + 0.5) / w[src]
    order = np.lexsort((src, due))[:size]
    return src[order], idx[order]


class BlendedDataset(torch.utils.data.Dataset):
    """Samples of several datasets interleaved by weight. Its length defaults to the sum of theirs; a source
    asked for more samples than it has wraps around (its index is taken modulo its length)."""

    def __init__(self, datasets: list, weights: list[float], size: int | None = None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"need one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
        self.datasets = datasets
        self.weights = list(weights)
        self.size = size if size is not None else sum(len(d) for d in datasets)
        self.source, idx = blend_assignment(self.weights, self.size)
        lens = np.array([len(d) for d in datasets], dtype=np.int64)
        self.index = idx % lens[self.source]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.datasets[int(self.source[i])][int(self.index[i])]


def build_dataset(cfg: DataConfig, split: str):
    """The packed dataset of ``split`` over ``cfg``'s data directory (data_dir.py), verified against the
    tokenizer saved there."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r} must be 'train' or 'val'")
    if cfg.synthetic.task:  # rows generated when read (data_pipeline/synthetic.py)
        from hybridtron.data_pipeline.synthetic import SyntheticDataset

        return SyntheticDataset(cfg, split)
    out = data_dir(cfg)
    meta = read_meta(out / "tokenizer")
    if meta is None:
        raise ShardError(f"{out / 'tokenizer'} holds no tokenizer; run `hybridtron prepare` for data.out_dir={out}")
    parts = []
    for name in source_names(cfg):
        reader = SplitReader(out / name / split, fingerprint=meta["fingerprint"])
        parts.append(PackedDataset(reader, cfg.seq_len, name=f"{name}/{split}"))
    if len(parts) == 1:
        return parts[0]
    return BlendedDataset(parts, [s.weight for s in cfg.sources])
