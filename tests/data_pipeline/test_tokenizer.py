from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from hybridtron.data_pipeline import Tokenizer, load_tokenizer
from hybridtron.data_pipeline.tokenizer import train_bpe, train_sentencepiece

SAMPLES = [
    "def f(x):\n\treturn x  # trailing spaces   \n",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🚀🧪, RTL שלום\n",
    "  leading spaces, CRLF\r\nand\r\nmixed\n\n\nblank lines\t\t",
    "literal special strings <|eos|> <|bos|> <|pad|> must survive",
    "",
    "x",
]


def _corpus() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:10]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files] + SAMPLES


@pytest.fixture(scope="module", params=["bpe", "sentencepiece"])
def tok(request) -> Tokenizer:
    train = train_bpe if request.param == "bpe" else train_sentencepiece
    return train(_corpus(), vocab_size=400, max_chars=400_000)


def test_round_trip_exact(tok):
    for s in SAMPLES + _corpus()[:3]:
        assert tok.decode(tok.encode(s)) == s
    assert [tok.decode(ids) for ids in tok.encode_batch(SAMPLES)] == SAMPLES


def test_specials_distinct_and_in_range(tok):
    ids = {tok.bos_id, tok.eos_id, tok.pad_id}
    assert len(ids) == 3
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.vocab_size == 400


def test_special_strings_in_text_are_not_special(tok):
    # an EOS id inside a document would look like a document boundary to the packer
    ids = tok.encode("a <|eos|> b <|bos|> c <|pad|>")
    assert not {tok.bos_id, tok.eos_id, tok.pad_id} & set(ids)


def test_batch_equals_single(tok):
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]


def test_save_load_identical(tok, tmp_path):
    tok.save(tmp_path / "t")
    assert (tmp_path / "t" / "tokenizer_meta.json").is_file()
    back = load_tokenizer(tmp_path / "t")
    assert back.fingerprint == tok.fingerprint
    assert back.encode_batch(SAMPLES) == tok.encode_batch(SAMPLES)
    assert (back.bos_id, back.eos_id, back.pad_id, back.vocab_size) == (tok.bos_id, tok.eos_id, tok.pad_id, 400)
    # the fingerprint is the sha256 of the file on disk
    import hashlib

    f = tmp_path / "t" / tok.filename
    assert back.fingerprint == hashlib.sha256(f.read_bytes()).hexdigest()


def test_load_plain_files(tok, tmp_path):
    tok.save(tmp_path / "t")
    plain = load_tokenizer(tmp_path / "t" / tok.filename)  # tokenizer.json or tokenizer.model directly
    assert plain.encode(SAMPLES[1]) == tok.encode(SAMPLES[1])
    assert plain.eos_id == tok.eos_id


def test_tampered_file_rejected(tok, tmp_path):
    d = tok.save(tmp_path / "t")
    f = d / tok.filename
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="fingerprint"):
        load_tokenizer(d)


def test_missing_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope.json")
