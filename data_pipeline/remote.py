"""Sources at fsspec URLs: ``https://``, ``s3://``, ``gs://`` or any protocol whose fsspec package is installed.

A URL names one file, a "directory" (a prefix; over HTTP, a URL ending in ``/`` whose page links to the files,
as a static file server's index does) or a glob; the files are listed in the order local files are (sorted by
path component, hidden names skipped). A file's stamp is ``[url, size, version]``, the version being what the
store says identifies its content or its time (the first of ETag, an MD5, Last-Modified, mtime ... in ``info()``,
e.g. ``ETag="5d41..."``); prepare compares stamps on resume exactly as it compares local ``[path, size, mtime]``
ones, and a new version of the same size is re-read and compared by content hash as a touched local file is.

Files are opened through ``fs.open(path, "rb")``: bounded reads (HTTP range requests, S3 ranged GETs), so the
readers in sources.py stream a remote file as they stream a local one and emit the same documents. A remote
failure (host unreachable, 404, access denied, a protocol whose package is missing) stops prepare with one line
naming the URL and what to do (``RemoteSourceError``); unlike a local unreadable file it is never counted as a
bad record and skipped: a network blip must not silently drop data. Credentials and endpoints come from each
package's usual environment (AWS_* variables and profiles for s3, Google's default credentials for gs) or
fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>`` variables, which also reach prepare's worker processes.
"""

from __future__ import annotations

import io
import re
from datetime import datetime, timezone
from pathlib import PurePosixPath
from urllib.parse import urlsplit

from hybridtron.data_pipeline.errors import DataError, RemoteSourceError, one_line

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# what identifies a remote file's version in an fsspec info() dict, best first (HTTP, S3, GCS, Azure, local, ...)
_EXTRA_PROTOCOLS = ("http", "https", "s3", "s3a")  # what hybridtron's `remote` extra installs the packages for
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "Content-MD5", "Digest", "LastModified", "Last-Modified",
                 "last_modified", "updated", "mtime", "modified")


def is_url(path: object) -> bool:
    """Whether a source path is an fsspec URL (``proto://...``) rather than a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def url_suffix(url: str) -> str:
    """The extension of the file a URL names (its query string aside)."""
    return PurePosixPath(urlsplit(url).path).suffix


def filesystem(url: str, doing: str = "read"):
    """(fsspec filesystem, path within it) for ``url``; a missing package or an unknown protocol in one line."""
    proto = url.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:
        raise RemoteSourceError(f"cannot {doing} {one_line(url)}: reading URLs needs the 'fsspec' package; "
                                f"pip install fsspec (and the package for {proto}://)") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # fsspec's message names the package, e.g. "Install s3fs to access S3"
        todo = ("pip install 'hybridtron[remote]' (aiohttp for http(s), s3fs for s3)" if proto in _EXTRA_PROTOCOLS
                else "install the package it names")
        raise RemoteSourceError(f"cannot {doing} {one_line(url)}: {proto}:// needs a package that is not installed "
                                f"({one_line(e)}); {todo}") from None
    except ValueError as e:  # "Protocol not known: foo"
        raise RemoteSourceError(f"cannot {doing} {one_line(url)}: fsspec knows no protocol {proto!r} ({one_line(e)}); "
                                f"check the URL, or install the fsspec package for it") from None


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def remote_error(url: str, exc: BaseException, doing: str = "read") -> RemoteSourceError:
    """One line saying why ``url`` could not be listed or read and what to do; ``.kind`` says which case it is
    (package, connect, denied, range, missing, other)."""
    chain = _chain(exc)
    host = urlsplit(url).netloc or url
    status = next((s for x in chain if isinstance(s := getattr(x, "status", None), int)), None)

    def connect(x: BaseException) -> bool:  # aiohttp's ClientConnectorError, botocore's EndpointConnectionError
        return isinstance(x, (ConnectionError, TimeoutError)) or "Connect" in type(x).__name__

    if any(isinstance(x, ImportError) for x in chain):
        kind, why, todo = "package", f"a package it needs is missing ({exc})", "install it"
    elif any(connect(x) for x in chain):
        cause = next(x for x in chain if connect(x))
        kind = "connect"
        why = f"cannot connect to {host} ({cause})" if url.startswith("http") else f"cannot connect ({cause})"
        todo = "check the URL and the network (and endpoint settings such as AWS_ENDPOINT_URL), then run prepare again"
    elif status in (401, 403) or any(isinstance(x, PermissionError) for x in chain):
        kind, why = "denied", f"access denied{f' (HTTP {status})' if status else ''}"
        todo = ("give credentials the way its fsspec package reads them (for s3: AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY or AWS_PROFILE; for gs: Google's default credentials)")
    elif any(re.search(r"range request|seek streaming", str(x)) for x in chain):
        kind, why = "range", f"its server does not answer HTTP range requests ({exc})"
        todo = "serve it from one that does (any static file server or object store), or copy it locally"
    elif status in (404, 410) or any(isinstance(x, FileNotFoundError) for x in chain):
        kind, why = "missing", f"not found{f' (HTTP {status})' if status else ''}"
        todo = "check the URL (a directory over HTTP ends in /)"
    else:
        kind, why = "other", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        todo = "check the URL and the network, then run prepare again (it resumes)"
    err = RemoteSourceError(f"cannot {doing} {one_line(url)}: {one_line(why)[:300]}; {todo}")
    err.kind = kind
    return err


def _version(info: dict) -> str:
    for key in _VERSION_KEYS:
        v = info.get(key)
        if v is None or v == "":
            continue
        if isinstance(v, datetime):  # one instant, one string, whichever time zone the listing used
            v = (v if v.tzinfo else v.replace(tzinfo=timezone.utc)).astimezone(timezone.utc).isoformat()
        return f"{key}={v}"
    return ""


def _sort_key(url: str) -> list[str]:
    return url.split("/")  # by component, as local Paths sort (a/b before a-c)


def list_files(url: str) -> tuple[list[str], bool]:
    """(the files ``url`` names, sorted, as URLs; whether it named a directory). Errors: RemoteSourceError."""
    fs, root = filesystem(url, "list")
    http = "http" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    magic = re.compile(r"[*\[]" if http else r"[*?\[]")  # over HTTP "?" starts a query
    try:
        fs.invalidate_cache()  # a listing from an earlier prepare in this process may be stale
        m = magic.search(root)
        if m:
            base = root[: m.start()].rsplit("/", 1)[0]
            # fsspec's glob and find take an unreachable host or a refusal for "no files": ask first
            try:
                if base.split("://")[-1]:
                    fs.info(base)
            except Exception as e:
                err = remote_error(url, e, "list")
                if err.kind != "missing":  # a missing directory: the glob matches no files, said below
                    raise err from None
            found = fs.glob(root, detail=True)
            names = [n for n, i in found.items() if i.get("type") != "directory" and not n.endswith("/")]
            is_dir = False
        else:
            info = fs.info(root)  # also what stops a directory's find, which would answer "no files"
            # over HTTP every URL is a "file": one ending in / (or redirected to one) is a directory's index page
            is_dir = root.endswith("/") or info.get("type") == "directory" or (
                http and str(info.get("url", "")).endswith("/"))
            if is_dir:
                base = root.rstrip("/")
                names = [n for n in fs.find(root) if not n.endswith("/")]
            else:
                base, names = None, [root]
    except DataError:
        raise
    except Exception as e:
        raise remote_error(url, e, "list") from None
    urls = []
    for n in names:
        rel = n[len(base):].lstrip("/") if base is not None and n.startswith(base) else ""
        if any(part.startswith(".") for part in rel.split("/")):
            continue  # hidden, as local listings skip them
        if http and ("?" in rel or "#" in rel):
            continue  # an index page's sort or anchor links (Apache's ?C=N;O=D), not files
        urls.append(fs.unstrip_protocol(n))
    return sorted(set(urls), key=_sort_key), is_dir


def stamp(url: str) -> list:
    """[url, size, version] of a remote file."""
    fs, path = filesystem(url)
    try:
        info = fs.info(path)
    except Exception as e:
        raise remote_error(url, e, "read") from None
    if info.get("size") is None:
        raise RemoteSourceError(f"cannot read {one_line(url)}: its server gives no size for it (no Content-Length "
                                f"in its answer to HEAD); serve it from a server that does, or copy it locally")
    return [url, int(info["size"]), _version(info)]


def open_file(url: str) -> io.BufferedReader:
    """A binary, seekable file object reading ``url`` in bounded requests. Buffered by ``io``: fsspec's own files
    lack ``readline(limit)``, which the jsonl reader uses to bound a line."""
    fs, path = filesystem(url)
    try:
        return io.BufferedReader(fs.open(path, "rb"), buffer_size=1 << 20)
    except Exception as e:
        raise remote_error(url, e, "read") from None


def check_unchanged(fh, stamp: list) -> None:
    """Stop when the file prepare opened is not the one it stamped (its size or version differ)."""
    details = getattr(getattr(fh, "raw", fh), "details", None) or {}
    if details.get("size") is None:
        return
    size, version = int(details["size"]), _version(details)
    if size != stamp[1] or (version and stamp[2] and version != stamp[2]):
        raise RemoteSourceError(
            f"{one_line(stamp[0])} changed while prepare was reading it (size {stamp[1]} -> {size} bytes, "
            f"{stamp[2] or 'no version'} -> {version or 'no version'}); re-run `hybridtron prepare` once it is written"
        )
