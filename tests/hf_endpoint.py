"""A local Hugging Face-compatible endpoint for the tests: the real client speaks to it.

It answers what huggingface_hub asks for a search, a repository's files and a download,
with the headers it reads (`X-Repo-Commit`, `ETag`, `X-Linked-Etag`, `X-Linked-Size`,
`X-Error-Code`) and HTTP ranges, and it counts every byte it serves so tests can prove a
resumed download did not fetch anything twice.  Tests point `HF_ENDPOINT` at it.

Knobs a real hub lacks, for what it cannot do on demand: `hold_after` stops a download
after that many bytes until `release()` (so a test can pause at a known point without
timing), `ignore_ranges` answers a range request with the whole file, `wrong_sha256`
publishes a wrong checksum, `claimed_size` announces a size bigger than any disk, and
repositories can be gated.  Files can be kept in git instead of LFS (`in_git`), as small
files on the real hub are; `redirect_to` sends downloads to a second endpoint, as the
hub sends them to its CDN, and every endpoint records which requests carried a token.

The hostile mode: a hub that lies, as a mirror, a proxy or a spoofed plain-http endpoint
may.  A repository's file names and commit id are whatever a test gives it; on top,
`published_sha256` announces any string as a file's SHA-256, `etag` any string as the
ETag of a file kept in git, and `extra_bytes` streams more (or, negative, fewer) bytes
than the file has, with a Content-Length to match.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

__all__ = ["HubEndpoint", "HubRepo", "Served"]


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, Path]  # path in the repository -> local file
    commit: str = "0" * 32 + "c0ffee01"
    downloads: int = 0
    last_modified: str = "2026-11-01T00:00:00.000Z"
    gated: bool = False
    token: str = "hf_test_token"  # the one token a gated repository accepts
    wrong_sha256: set[str] = field(default_factory=set)
    claimed_size: dict[str, int] = field(default_factory=dict)  # a size to announce instead
    gguf: dict = field(default_factory=dict)
    in_git: set[str] = field(default_factory=set)  # listed without LFS, identified by git blob id
    # The hostile mode (see the module's docstring): values announced instead of the truth.
    published_sha256: dict[str, str] = field(default_factory=dict)
    etag: dict[str, str] = field(default_factory=dict)
    extra_bytes: dict[str, int] = field(default_factory=dict)

    def sha256(self, path: str) -> str:
        return _sha256(self.files[path])

    def git_blob_id(self, path: str) -> str:
        data = self.files[path].read_bytes()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def announced_sha256(self, path: str) -> str:
        if path in self.published_sha256:
            return self.published_sha256[path]
        return "0" * 64 if path in self.wrong_sha256 else self.sha256(path)

    def announced_etag(self, path: str) -> str:
        if path in self.etag:
            return self.etag[path]
        return self.git_blob_id(path) if path in self.in_git else self.sha256(path)


@dataclass
class Served:
    """One GET of a file: where its range started and how many bytes went out."""

    path: str
    start: int
    sent: int = 0
    status: int = 200


class HubEndpoint:
    def __init__(self, repos: list[HubRepo], *, host: str = "127.0.0.1",
                 redirect_to: "HubEndpoint | None" = None, open_to_all: bool = False) -> None:
        self.repos = {r.repo_id: r for r in repos}
        self.served: list[Served] = []
        self.requests: list[str] = []  # every request, "GET /path?query"
        self.authorized: list[str] = []  # the requests that carried an Authorization header
        self.hold_after: int | None = None  # bytes per response before holding
        self.hold_path: str | None = None  # only that file's responses are held; None: all
        self.ignore_ranges = False  # answer 200 and the whole file, as some CDNs do
        self.redirect_to = redirect_to  # downloads are sent there (302), as the hub sends them to its CDN
        self.open_to_all = open_to_all  # a CDN: serves gated files to anyone sent there (signed URLs)
        self._release = threading.Event()
        self.holding = threading.Event()  # set while a response is held
        self._server = ThreadingHTTPServer((host, 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        assert isinstance(host, str)
        return f"http://{host}:{port}"

    def __enter__(self) -> "HubEndpoint":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    def hold(self, after: int, path: str | None = None) -> None:
        """Hold every download (or only that of `path`) after `after` bytes, until `release()`."""
        self.hold_after = after
        self.hold_path = path
        self._release.clear()
        self.holding.clear()

    def release(self) -> None:
        self.hold_after = None
        self._release.set()

    def bytes_served(self, path: str) -> int:
        return sum(s.sent for s in self.served if s.path == path)


def _handler(hub: HubEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        def _route(self, head: bool) -> None:
            hub.requests.append(f"{self.command} {self.path}")
            if self.headers.get("Authorization") is not None:
                hub.authorized.append(f"{self.command} {self.path}")
            url = urlparse(self.path)
            query = parse_qs(url.query)
            path = unquote(url.path)
            if path == "/api/models":
                return self._search(query)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                return self._info(m.group(1))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
            if m:
                return self._tree(m.group(1))
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._resolve(m.group(1), m.group(2), m.group(3), head)
            self._error(404, "Not found", "")

        def _search(self, query: dict[str, list[str]]) -> None:
            words = (query.get("search") or [""])[0].lower().split()
            found = [r for r in hub.repos.values() if all(w in r.repo_id.lower() for w in words)]
            found.sort(key=lambda r: r.last_modified if (query.get("sort") or [""])[0] == "lastModified"
                       else r.downloads, reverse=True)
            limit = int((query.get("limit") or ["1000"])[0])
            self._json([{"_id": r.repo_id, "id": r.repo_id, "modelId": r.repo_id,
                         "downloads": r.downloads, "likes": 0, "lastModified": r.last_modified,
                         "gated": "manual" if r.gated else False, "tags": ["gguf"]}
                        for r in found[:limit]])

        def _info(self, repo_id: str) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            siblings = []
            for path, local in repo.files.items():
                size = repo.claimed_size.get(path, local.stat().st_size)
                if path in repo.in_git:
                    siblings.append({"rfilename": path, "size": size, "blobId": repo.git_blob_id(path)})
                    continue
                sha = repo.announced_sha256(path)
                siblings.append({"rfilename": path, "size": size, "blobId": sha[:40],
                                 "lfs": {"sha256": sha, "size": size, "pointerSize": 134}})
            self._json({"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": repo.commit,
                        "private": False, "gated": "manual" if repo.gated else False,
                        "downloads": repo.downloads, "likes": 0, "tags": ["gguf"],
                        "lastModified": repo.last_modified, "siblings": siblings,
                        "gguf": repo.gguf or None})

        def _tree(self, repo_id: str) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            self._json([{"type": "file", "oid": repo.sha256(p)[:40], "size": f.stat().st_size, "path": p,
                         "lfs": {"oid": repo.sha256(p), "size": f.stat().st_size, "pointerSize": 134}}
                        for p, f in repo.files.items()])

        def _resolve(self, repo_id: str, revision: str, file: str, head: bool) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            if repo.gated and not hub.open_to_all and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._error(401, "Access to this repository is restricted.", "GatedRepo")
            if revision not in ("main", repo.commit) or file not in repo.files:
                return self._error(404, "Entry not found", "EntryNotFound")
            data = repo.files[file].read_bytes()
            extra = repo.extra_bytes.get(file, 0)
            data = data + b"\0" * extra if extra >= 0 else data[:extra]
            etag = repo.announced_etag(file)
            linked_size = str(repo.claimed_size.get(file, repo.files[file].stat().st_size))
            if hub.redirect_to is not None:
                self.send_response(302)
                self.send_header("Location", hub.redirect_to.url + self.path)
                self.send_header("Content-Length", "0")
                self.send_header("X-Repo-Commit", repo.commit)
                if file not in repo.in_git:
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", linked_size)
                self.end_headers()
                return
            start = 0
            status = 200
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if match and not hub.ignore_ranges:
                start, status = int(match.group(1)), 206
            body = data[start:]
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{etag}"')
            self.send_header("X-Repo-Commit", repo.commit)
            if file not in repo.in_git:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", linked_size)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if head:
                return
            served = Served(file, start, status=status)
            hub.served.append(served)
            self._send_body(body, served)

        def _send_body(self, body: bytes, served: Served) -> None:
            step = 256 * 1024
            try:
                for offset in range(0, len(body), step):
                    hold = hub.hold_after
                    if hold is not None and served.sent >= hold and hub.hold_path in (None, served.path):
                        hub.holding.set()
                        hub._release.wait(60)
                    piece = body[offset:offset + step]
                    self.wfile.write(piece)
                    served.sent += len(piece)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _repo(self, repo_id: str) -> HubRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "Repository not found", "RepoNotFound")
            return repo

        def _json(self, data: object) -> None:
            body = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, message: str, code: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler


_digests: dict[tuple[str, float], str] = {}


def _sha256(path: Path) -> str:
    key = (str(path), path.stat().st_mtime)
    if key not in _digests:
        _digests[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _digests[key]
