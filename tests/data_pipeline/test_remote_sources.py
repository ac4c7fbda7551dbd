"""Sources at URLs (data_pipeline/remote.py), against servers started here on localhost: an HTTP file server
(Python's http.server with the range requests and ETags fsspec's HTTP filesystem relies on) and, where moto and
s3fs are installed (the dev extra), an S3 one. The same corpus read locally and remotely must give byte-identical
shards and the same counts; a remote file changed between two prepares is refused naming its URL; an unreachable
host, a missing file or an unknown protocol is one line naming the URL, before any work."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hybridtron.configs.job import DataConfig, SourceConfig, TokenizerConfig
from hybridtron.data_pipeline import RemoteSourceError, SourceChangedError, prepare_data
from hybridtron.data_pipeline.sources import resolve_files

from .helpers import tree_bytes

pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp (the dev extra installs it)")

TEXTS = {
    "a.txt": "def alpha():\n    return 1\n" * 40,
    "b.txt": "Plain prose, a few sentences. " * 50,
    "c-d.txt": "x = [i * i for i in range(10)]\n" * 30,
    "c/e.txt": "class Beta:\n    pass\n" * 25,  # sorts after c-d.txt by path component, before it as a string
    ".hidden.txt": "never read",
}
RECORDS = [{"text": f"record {i}: " + "word " * (5 + i)} for i in range(12)]


def _write_corpus(root: Path) -> None:
    for name, text in TEXTS.items():
        (root / "texts" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "texts" / name).write_text(text)
    lines = [json.dumps(r) for r in RECORDS]
    lines.insert(5, '{"text": "a line cut short')  # malformed JSON: counted and skipped
    (root / "records.jsonl").write_text("\n".join(lines) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"row {i} " * (3 + i) for i in range(9)]}), root / "table.parquet")


class _RangeHandler(SimpleHTTPRequestHandler):
    """Static files with what a real file server sends and fsspec needs: Content-Length and Accept-Ranges on
    HEAD, 206 answers to Range requests, an ETag (from mtime and size, as nginx makes it) and Last-Modified.
    Directories: http.server's index page (links fsspec's find follows), a path without / redirected to it."""

    def send_head(self):
        path = self.translate_path(self.path)
        if os.path.isdir(path) or "forbidden" in self.path:
            if "forbidden" in self.path:
                self.send_error(403)
                return None
            return super().send_head()
        try:
            f = open(path, "rb")
        except OSError:
            self.send_error(404)
            return None
        with f:
            st = os.fstat(f.fileno())
            data = f.read()
        size = len(data)
        start, end, status = 0, size - 1, 200
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if m and (m[1] or m[2]):
            if m[1]:
                start, end = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)
            else:
                start = max(0, size - int(m[2]))
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{st.st_mtime_ns:x}-{size:x}"')
        self.send_header("Last-Modified", self.date_time_string(int(st.st_mtime)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        return io.BytesIO(data[start : end + 1])

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    _write_corpus(root)
    return root


@pytest.fixture(scope="module")
def http_url(corpus):
    """The corpus's directory served at http://127.0.0.1:PORT."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: _RangeHandler(*a, directory=str(corpus)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _cfg(base: str, out: Path, tokenizer_json: Path, **kw) -> DataConfig:
    base = base.rstrip("/")
    return DataConfig(
        sources=[SourceConfig(path=f"{base}/texts/", name="texts"),
                 SourceConfig(path=f"{base}/records.jsonl", name="records"),
                 SourceConfig(path=f"{base}/table.parquet", name="table")],
        tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)),
        out_dir=str(out), seq_len=32, shard_docs=2, val_fraction=0.3, seed=0, max_malformed_fraction=0.5, **kw,
    )


def _comparable(out: Path, base: str) -> dict[str, object]:
    """tree_bytes with each manifest parsed and what names where the files were read from taken out: the
    recorded files' paths and stamps (a local mtime, a remote version), the digest of those stamps, and the
    base of the places in the bad-record examples. Shards, tokenizer and counts stay byte for byte."""
    out_tree: dict[str, object] = {}
    for rel, data in tree_bytes(out).items():
        if not rel.endswith("manifest.json"):
            out_tree[rel] = data
            continue
        m = json.loads(data)
        m.pop("inputs_digest", None)
        src = m.get("source") or {}
        src["files"] = [[f[0].split(base.rstrip("/"), 1)[-1], f[1], f[3]] for f in src.get("files", [])]
        src["examples"] = {r: [e.replace(base.rstrip("/"), "BASE") for e in v] for r, v in src.get("examples", {}).items()}
        out_tree[rel] = m
    return out_tree


def _assert_same_as_local(corpus, base, tmp_path, tokenizer_json, remote_kw=None, **kw):
    local = prepare_data(_cfg(str(corpus), tmp_path / "local", tokenizer_json, **kw), log=lambda *a: None)
    far = prepare_data(_cfg(base, tmp_path / "remote", tokenizer_json, **kw, **(remote_kw or {})),
                       log=lambda *a: None)
    assert far.stats == local.stats
    a, b = _comparable(tmp_path / "local", str(corpus)), _comparable(tmp_path / "remote", base)
    assert sorted(a) == sorted(b)
    for rel in a:
        assert a[rel] == b[rel], rel
    # what they read: every file but the hidden one, each with its content hash
    m = json.loads((tmp_path / "remote" / "texts" / "train" / "manifest.json").read_text())
    files = m["source"]["files"]
    assert [f[0] for f in files] == [f"{base}/texts/{n}" for n in ("a.txt", "b.txt", "c/e.txt", "c-d.txt")]
    assert all(isinstance(f[2], str) and f[2] and f[3] for f in files)
    rec = json.loads((tmp_path / "remote" / "records" / "train" / "manifest.json").read_text())["source"]
    assert rec["skipped"] == {"malformed_json": 1} and rec["documents"] == len(RECORDS)


# ---- HTTP -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("streaming", [True, False])
def test_http_source_gives_the_local_shards(corpus, http_url, tmp_path, tokenizer_json, streaming):
    _assert_same_as_local(corpus, http_url, tmp_path, tokenizer_json, streaming=streaming)


def test_http_part_of_a_parallel_prepare(corpus, http_url, tmp_path, tokenizer_json):
    """A parallel prepare (parts.py) hands each worker its part's stamps and the worker reads the files they name:
    the URLs must reach it intact (``Path`` would collapse their ``//``) and give the local part's bytes. Run here,
    in this process, what a worker runs (a real pool costs ~20 s of process start on a 2-core VM;
    test_parallel_prepare.py covers the pool itself)."""
    from hybridtron.data_pipeline.parts import PartJob, tokenize_part
    from hybridtron.data_pipeline.sources import file_stamp

    out = {}
    for side, base in (("local", str(corpus)), ("remote", http_url)):
        cfg = _cfg(base, tmp_path / side, tokenizer_json, workers=2)
        files, fmt = resolve_files(cfg.sources[0])
        stamps = [file_stamp(f) for f in files]
        (tmp_path / side / "parts").mkdir(parents=True)
        rec = tokenize_part(PartJob(cfg, 0, "texts", 0, stamps, fmt, str(tokenizer_json.parent),
                                    str(tmp_path / side / "parts"), str(tmp_path / side / "cache"), 1))
        out[side] = (rec, {p.name: p.read_bytes() for p in (tmp_path / side / "parts").iterdir()
                           if p.suffix in (".bin", ".idx")})
    (local, local_bytes), (far, far_bytes) = out["local"], out["remote"]
    assert far["files"] == [f"{http_url}/texts/{n}" for n in ("a.txt", "b.txt", "c/e.txt", "c-d.txt")]
    assert [f[0] for f in far["report"]["files"]] == far["files"]
    assert [f[3] for f in far["report"]["files"]] == [f[3] for f in local["report"]["files"]]
    assert far["n_docs"] == local["n_docs"] == 4 and far_bytes == local_bytes


def test_http_listing_glob_and_order(corpus, http_url):
    files, fmt = resolve_files(SourceConfig(path=f"{http_url}/texts/*.txt"))
    assert (files, fmt) == ([f"{http_url}/texts/a.txt", f"{http_url}/texts/b.txt", f"{http_url}/texts/c-d.txt"],
                            "text")
    # a directory URL without its slash: the server's redirect says it is one
    files, _ = resolve_files(SourceConfig(path=f"{http_url}/texts"))
    assert files == [f"{http_url}/texts/{n}" for n in ("a.txt", "b.txt", "c/e.txt", "c-d.txt")]
    # a directory of mixed formats keeps the asked one, as locally
    files, fmt = resolve_files(SourceConfig(path=f"{http_url}/", format="jsonl"))
    assert (files, fmt) == ([f"{http_url}/records.jsonl"], "jsonl")


def test_changed_http_file_is_refused(corpus, http_url, tmp_path, tokenizer_json, monkeypatch):
    cfg = _cfg(http_url, tmp_path / "out", tokenizer_json)
    prepare_data(cfg, log=lambda *a: None)
    path = corpus / "texts" / "b.txt"
    before = path.read_bytes()
    st = path.stat()
    try:
        # touched: same bytes, new mtime, so a new ETag; the recorded content hash says it is the same file
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        prepare_data(cfg, log=lambda *a: None)
        # same size, other bytes
        path.write_bytes(before.replace(b"Plain", b"Plane"))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
        with pytest.raises(SourceChangedError) as e:
            prepare_data(cfg, log=lambda *a: None)
        assert f"file {http_url}/texts/b.txt changed" in str(e.value) and "\n" not in str(e.value)
        # another size
        path.write_bytes(before + b"more")
        with pytest.raises(SourceChangedError, match=re.escape(f"{http_url}/texts/b.txt changed (size")):
            prepare_data(cfg, log=lambda *a: None)
        # rebuild re-reads it
        prepare_data(_cfg(http_url, tmp_path / "out", tokenizer_json, on_source_change="rebuild"),
                     log=lambda *a: None)
    finally:
        path.write_bytes(before)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("what", ["404", "unreachable", "unreachable dir", "unreachable glob", "403", "protocol",
                                  "package"])
def test_remote_errors_are_one_line(http_url, tmp_path, what):
    if what == "package":
        try:
            import gcsfs  # noqa: F401
            pytest.skip("gcsfs is installed: no protocol here lacks its package")
        except ImportError:
            pass
    url = {
        "404": f"{http_url}/texts/missing.txt",
        "unreachable": f"http://127.0.0.1:{_closed_port()}/corpus/a.txt",
        # fsspec's find and glob answer "no files" for a host they cannot reach: not what the user should read
        "unreachable dir": f"http://127.0.0.1:{_closed_port()}/corpus/",
        "unreachable glob": f"http://127.0.0.1:{_closed_port()}/corpus/*.jsonl",
        "403": f"{http_url}/forbidden/a.txt",
        "protocol": "nosuchproto://bucket/a.txt",
        "package": "gs://bucket/corpus/*.jsonl",
    }[what]
    expect = {"404": "not found (HTTP 404); check the URL", "unreachable": "cannot connect to 127.0.0.1",
              "unreachable dir": "cannot connect to 127.0.0.1", "unreachable glob": "cannot connect to 127.0.0.1",
              "403": "access denied (HTTP 403)", "protocol": "fsspec knows no protocol 'nosuchproto'",
              "package": "gs:// needs a package that is not installed (Please install gcsfs"}[what]
    # a tokenizer to train: the error must come before that work
    cfg = DataConfig(sources=[SourceConfig(path=url)], out_dir=str(tmp_path / "out"),
                     tokenizer=TokenizerConfig(kind="bpe", vocab_size=300))
    t0 = time.monotonic()
    with pytest.raises(RemoteSourceError) as e:
        prepare_data(cfg, log=lambda *a: None)
    msg = str(e.value)
    assert msg.startswith(f"cannot list {url}: ") and expect in msg and "\n" not in msg, msg
    assert time.monotonic() - t0 < 5
    assert not (tmp_path / "out").exists()


# ---- S3 (moto's server) ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_url(corpus):
    """The corpus uploaded to s3://corpus on moto's S3 server, reached the way a user reaches an S3-compatible
    store: AWS_ENDPOINT_URL and credentials in the environment (which prepare's worker processes inherit)."""
    pytest.importorskip("s3fs", reason="the S3 tests need s3fs (the dev extra installs it)")
    server_mod = pytest.importorskip("moto.server", reason="the S3 tests need moto's server (the dev extra)")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("corpus")
    for f in sorted(corpus.rglob("*")):
        if f.is_file():
            fs.pipe(f"corpus/{f.relative_to(corpus).as_posix()}", f.read_bytes())
    try:
        yield "s3://corpus", fs
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_s3_source_gives_the_local_shards(corpus, s3_url, tmp_path, tokenizer_json):
    _assert_same_as_local(corpus, s3_url[0], tmp_path, tokenizer_json)


def test_changed_s3_object_is_refused(corpus, s3_url, tmp_path, tokenizer_json):
    url, fs = s3_url
    cfg = _cfg(url, tmp_path / "out", tokenizer_json)
    prepare_data(cfg, log=lambda *a: None)
    before = (corpus / "records.jsonl").read_bytes()
    try:
        fs.pipe("corpus/records.jsonl", before.replace(b"record 3", b"record 4"))  # same size, new ETag
        with pytest.raises(SourceChangedError) as e:
            prepare_data(cfg, log=lambda *a: None)
        assert f"file {url}/records.jsonl changed" in str(e.value) and "\n" not in str(e.value)
    finally:
        fs.pipe("corpus/records.jsonl", before)


def test_missing_s3_object_is_one_line(s3_url, tmp_path):
    url = f"{s3_url[0]}/nothing-here.jsonl"
    with pytest.raises(RemoteSourceError, match=re.escape(f"cannot list {url}: not found")):
        resolve_files(SourceConfig(path=url))


def test_http_jsonl_cut_into_pieces_reads_as_the_local_file(corpus, http_url, tmp_path, tokenizer_json):
    """A remote jsonl file bigger than a part is cut at the same line starts as its local copy (ranged reads), and
    each piece tokenizes to the local piece's bytes; in this process, as test_http_part_of_a_parallel_prepare."""
    from hybridtron.data_pipeline.parts import part_job, plan_source, tokenize_part
    from hybridtron.data_pipeline.sources import file_stamp

    out = {}
    for side, base in (("local", str(corpus)), ("remote", http_url)):
        cfg = _cfg(base, tmp_path / side, tokenizer_json)
        files, fmt = resolve_files(cfg.sources[1])
        stamps = [file_stamp(f) for f in files]
        plan = plan_source(stamps, fmt, 200)
        (tmp_path / side / "parts").mkdir(parents=True)
        recs = [tokenize_part(part_job(cfg, 1, "records", k, part, stamps, fmt, tokenizer_json.parent,
                                       tmp_path / side / "parts", tmp_path / side / "cache", 1))
                for k, part in enumerate(plan)]
        out[side] = (plan, [(r["n_docs"], r["lines"], r["report"]["skipped"]) for r in recs],
                     {p.name: p.read_bytes() for p in (tmp_path / side / "parts").iterdir() if p.suffix != ".json"})
    assert len(out["local"][0]) > 3 and out["remote"] == out["local"]
    assert sum(n for n, _, _ in out["local"][1]) == len(RECORDS)
