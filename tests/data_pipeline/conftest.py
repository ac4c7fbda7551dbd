"""Shared small corpora: a few stdlib files, a 300-id BPE, seq_len 32, so the folder runs in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hybridtron.configs.job import DataConfig, SourceConfig, TokenizerConfig
from hybridtron.data_pipeline import prepare_data

N_FILES = 12


def stdlib_cfg(out_dir: Path, **kw) -> DataConfig:
    base = dict(
        sources=[SourceConfig(path="stdlib", max_files=N_FILES)],
        tokenizer=TokenizerConfig(kind="bpe", vocab_size=300, sample_mb=0.3),
        out_dir=str(out_dir),
        seq_len=32,
        shard_docs=3,
        val_fraction=0.2,
        seed=0,
    )
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture(scope="session")
def prepared_stdlib(tmp_path_factory):
    """One prepared corpus for read-only tests; copy it (``copy_prepared``) before damaging it."""
    out = tmp_path_factory.mktemp("stdlib")
    cfg = stdlib_cfg(out)
    return cfg, prepare_data(cfg, log=lambda *a: None)


@pytest.fixture
def copy_prepared(prepared_stdlib, tmp_path):
    cfg, _ = prepared_stdlib
    dst = tmp_path / "copy"
    shutil.copytree(cfg.out_dir, dst, ignore=shutil.ignore_patterns(".hf_cache"))
    return stdlib_cfg(dst)


@pytest.fixture(scope="session")
def tokenizer_json(prepared_stdlib) -> Path:
    """The session's trained BPE as a plain tokenizer.json, to prepare other corpora without training again."""
    return Path(prepared_stdlib[0].out_dir) / "tokenizer" / "tokenizer.json"


def quiet(*_a, **_k) -> None:
    pass
