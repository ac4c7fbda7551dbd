"""The tokenizer's training text is a deterministic sample spread over the corpus, read within its budget
(data_pipeline/tokenizer_sample.py)."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

from hybridtron.configs.base import ConfigError
from hybridtron.configs.job import DataConfig, SourceConfig, TokenizerConfig, load_config
from hybridtron.data_pipeline import prepare_data, sources, tokenizer_sample
from hybridtron.data_pipeline.data_dir import default_data_dir, tokenizer_recipe
from hybridtron.data_pipeline.errors import DataError
from hybridtron.data_pipeline.prepare import get_tokenizer
from hybridtron.data_pipeline.tokenizer_sample import sample_texts

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxing frogs".split()


def _text(i: int, n_chars: int, extra: str = "") -> str:
    out, k, n = [], i, 0
    while n < n_chars:
        out.append(WORDS[k % len(WORDS)] + (extra if k % 3 == 0 else ""))
        n += len(out[-1]) + 1
        k = (k * 7 + 3) % 1_000_003
    return " ".join(out) + "\n"


def _corpus(root: Path, n: int, size: int, rare_from: int | None = None) -> Path:
    """``n`` text files of ``size`` characters; from file ``rare_from`` on each holds 'ж', which earlier ones lack."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        extra = "ж" if rare_from is not None and i >= rare_from else ""
        (root / f"doc_{i:04d}.txt").write_text(_text(i, size, extra), encoding="utf-8")
    return root


def _cfg(src: Path, out: Path, kind: str = "bpe", sample_mb: float = 0.05, **kw) -> DataConfig:
    return DataConfig(sources=[SourceConfig(path=str(src), **kw)], out_dir=str(out),
                      tokenizer=TokenizerConfig(kind=kind, vocab_size=300, sample_mb=sample_mb))


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_same_sources_give_the_same_tokenizer_bytes(kind, tmp_path):
    src = _corpus(tmp_path / "c", 40, 4000)
    a = get_tokenizer(_cfg(src, tmp_path / "a", kind), tmp_path / "a", log=lambda _: None)
    b = get_tokenizer(_cfg(src, tmp_path / "b", kind), tmp_path / "b", log=lambda _: None)
    file = "tokenizer.json" if kind == "bpe" else "tokenizer.model"
    assert (tmp_path / "a" / "tokenizer" / file).read_bytes() == (tmp_path / "b" / "tokenizer" / file).read_bytes()
    assert a.fingerprint == b.fingerprint
    # the corpus copied elsewhere is the same sample (the order is drawn from paths relative to the source)
    moved = tmp_path / "elsewhere" / "c"
    moved.parent.mkdir()
    src.rename(moved)
    c = get_tokenizer(_cfg(moved, tmp_path / "m", kind), tmp_path / "m", log=lambda _: None)
    assert c.fingerprint == a.fingerprint


def test_the_sample_is_spread_over_the_corpus(tmp_path):
    # 60 files of 2 kB: the first 40 never hold 'ж'. A budget of a quarter of the corpus read from its start
    # (the old prefix) would see none of it.
    src = _corpus(tmp_path / "c", 60, 2000, rare_from=40)
    cfg = _cfg(src, tmp_path / "out", sample_mb=0.03)
    samples: list = []
    text = "".join(sample_texts(cfg, [], samples=samples))
    assert "ж" in text and 25_000 <= len(text.encode()) <= 30_000
    read = sorted(samples[0].files_read)
    assert read[0] < str(src / "doc_0020.txt") and read[-1] > str(src / "doc_0040.txt"), read
    tok = get_tokenizer(cfg, tmp_path / "out", log=lambda _: None)
    assert tok.encode("ж") == tok.encode("ж") and len(tok.encode("ж")) == 1  # a merge of its two bytes
    # other seed, other sample
    other = "".join(sample_texts(DataConfig(**{**cfg.__dict__, "seed": 1}), []))
    assert other != text


def test_a_single_big_jsonl_file_is_sampled_through(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_sample, "WINDOW_BYTES", 10_000)
    f = tmp_path / "one.jsonl"
    with open(f, "w") as fh:
        for i in range(2000):
            fh.write(json.dumps({"text": f"record {i:05d} " + _text(i, 200)}) + "\n")
    cfg = _cfg(f, tmp_path / "out", sample_mb=0.05)  # a tenth of the file, in 5 windows
    reports: list = []
    docs = [t for t in sample_texts(cfg, reports) if t.startswith("record ")]
    ids = [int(t.split()[1]) for t in docs]
    assert ids == sorted(ids) and min(ids) < 100 and max(ids) > 1600, ids
    assert reports[0].documents == len(docs) and sum(reports[0].skipped.values()) == 0


def _count_reads(monkeypatch) -> list[int]:
    """The bytes read from source files through the readers' open()."""
    read = [0]

    class Counted:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.fh.close()

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def read(self, *a):
            b = self.fh.read(*a)
            read[0] += len(b)
            return b

        def readline(self, *a):
            b = self.fh.readline(*a)
            read[0] += len(b)
            return b

    def counted_open(path, mode="r", *a, **kw):
        return Counted(builtins.open(path, mode, *a, **kw))

    monkeypatch.setattr(sources, "open", counted_open, raising=False)
    monkeypatch.setattr(tokenizer_sample, "open", counted_open, raising=False)
    return read


@pytest.mark.parametrize("fmt", ["text", "jsonl"])
def test_reading_is_bounded_by_the_budget_not_the_corpus(fmt, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_sample, "WINDOW_BYTES", 40_000)
    if fmt == "text":
        src = _corpus(tmp_path / "c", 200, 5000)  # 1 MB
    else:
        src = tmp_path / "c.jsonl"
        src.write_text("".join(json.dumps({"text": _text(i, 500)}) + "\n" for i in range(2000)))  # ~1 MB
    corpus = sum(p.stat().st_size for p in ([src] if src.is_file() else src.iterdir()))
    read = _count_reads(monkeypatch)
    cfg = _cfg(src, tmp_path / "out", sample_mb=corpus / 10 / 1e6)
    text = "".join(sample_texts(cfg, []))
    budget = cfg.tokenizer.sample_mb * 1e6
    assert 0.95 * budget <= len(text.encode()) <= budget
    # past each window's share, at most: the document (text: a 5 kB file) or line it cuts, and for jsonl the
    # first 8 KiB at the window's place (is it binary?) and the line it lands in
    windows = len(tokenizer_sample.SourceSample(cfg.sources[0], cfg, int(budget)).windows())
    assert windows == 3 and read[0] <= budget + windows * (sources.SNIFF_BYTES + 5_000), (read[0], budget, corpus)


def test_the_sample_has_progress_lines(tmp_path):
    src = _corpus(tmp_path / "c", 30, 2000)
    logs: list[str] = []
    get_tokenizer(_cfg(src, tmp_path / "out", sample_mb=0.02), tmp_path / "out", log=logs.append)
    assert logs[0].startswith("training bpe tokenizer (vocab 300) on a sample of 0.02 MB"), logs
    assert any(m.startswith("tokenizer: sampled 20.00 kB of 60.") and "of 30 files) in " in m for m in logs), logs
    assert logs[-1].startswith("trained bpe tokenizer (vocab 300) on 0.0M characters in "), logs


@pytest.mark.parametrize("value", ["0", "-1", ".nan", ".inf"])
def test_bad_sample_mb_is_refused_in_one_line(value):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [("data.tokenizer.sample_mb", value)])
    msg = str(e.value)
    assert "\n" not in msg and "data.tokenizer.sample_mb=" in msg and "must be a number of MB > 0" in msg


def test_the_recipe_names_the_sample(tmp_path):
    base = load_config("tiny").data
    recipe = tokenizer_recipe(base)
    assert recipe["sample_mb"] == 20.0 and recipe["sample"] == tokenizer_sample.SAMPLE_VERSION and "seed" in recipe
    for key, value in [("data.tokenizer.sample_mb", "21"), ("data.seed", "1")]:
        assert default_data_dir(load_config("tiny", [(key, value)]).data) != default_data_dir(base), key


def test_train_max_chars_reads_old_data_but_trains_nothing(tmp_path):
    """A config (a saved run's) that sets the former train_max_chars still finds the data directory an older
    version prepared with it; it is refused, in one line saying what to set, where a tokenizer would be trained."""
    src = _corpus(tmp_path / "c", 10, 2000)
    cfg = _cfg(src, tmp_path / "out", sample_mb=0.01)
    prepare_data(cfg, log=lambda _: None)
    old = _cfg(src, tmp_path / "out")
    old.tokenizer.train_max_chars = 20_000_000
    meta_f = tmp_path / "out" / "tokenizer" / "tokenizer_meta.json"
    meta = json.loads(meta_f.read_text())
    meta_f.write_text(json.dumps({**meta, "config": tokenizer_recipe(old)}))  # what the older version recorded
    logs: list[str] = []
    prepare_data(old, log=logs.append)
    assert not any("training" in m for m in logs), logs
    old.out_dir = str(tmp_path / "new")
    with pytest.raises(DataError) as e:
        prepare_data(old, log=lambda _: None)
    msg = str(e.value)
    assert "\n" not in msg and "set data.tokenizer.train_max_chars=0 and data.tokenizer.sample_mb=20 " in msg
