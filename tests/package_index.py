"""A local package index for the tests: a PEP 503 "simple" index over HTTP, and sdists
whose build backend leaves a marker file when anything runs it.

A hostile index is what the engine build must survive, so `hostile_sdist` makes a
source distribution named like the pinned one whose in-tree build backend writes
`marker` the moment it is imported (as pip does to read an sdist's metadata), and asks
for a build dependency from the index whose own backend does the same.  A test that
finds the marker absent knows no code from the index ran.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["PackageIndex", "hostile_sdist", "sha256"]


class PackageIndex:
    """Serves `/simple/<project>/` pages linking each file with its sha256, and the files
    under `/files/`.  `requests` records every path asked for."""

    def __init__(self) -> None:
        self.projects: dict[str, dict[str, bytes]] = {}
        self.requests: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, project: str, filename: str, content: bytes) -> None:
        self.projects.setdefault(project, {})[filename] = content

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/simple"

    def __enter__(self) -> "PackageIndex":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def hostile_sdist(name: str, version: str, marker: Path, *, build_requires: str = "") -> bytes:
    """An sdist `<name>-<version>.tar.gz` (name as in its file name) whose build backend
    writes `marker` when imported and then answers like a working backend."""
    requires = f"[{build_requires!r}]" if build_requires else "[]"
    pyproject = (f"[build-system]\nrequires = {requires}\n"
                 'build-backend = "backend"\nbackend-path = ["hooks"]\n'
                 f'[project]\nname = "{name.replace("_", "-")}"\nversion = "{version}"\n')
    backend = (
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('the index ran code here')\n"
        "def get_requires_for_build_wheel(config_settings=None):\n    return []\n"
        "def get_requires_for_build_sdist(config_settings=None):\n    return []\n"
        "def prepare_metadata_for_build_wheel(directory, config_settings=None):\n"
        "    info = pathlib.Path(directory) / 'x.dist-info'\n"
        "    info.mkdir()\n"
        f"    (info / 'METADATA').write_text('Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n')\n"
        "    return info.name\n"
    )
    root = f"{name}-{version}"
    return _tar_gz({
        f"{root}/pyproject.toml": pyproject,
        f"{root}/hooks/backend.py": backend,
        f"{root}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{root}/vendor/llama.cpp/CMakeLists.txt": "message(FATAL_ERROR \"not llama.cpp\")\n",
    })


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


# --- helpers ------------------------------------------------------------------------------


def _tar_gz(files: dict[str, str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _handler(index: PackageIndex) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            index.requests.append(self.path)
            parts = [p for p in self.path.split("?")[0].split("/") if p]
            if len(parts) == 2 and parts[0] == "simple" and parts[1] in index.projects:
                links = "".join(
                    f'<a href="/files/{name}#sha256={sha256(content)}">{name}</a>\n'
                    for name, content in index.projects[parts[1]].items())
                self._send(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode(),
                           "text/html")
                return
            if len(parts) == 2 and parts[0] == "files":
                for files in index.projects.values():
                    if parts[1] in files:
                        self._send(files[parts[1]], "application/octet-stream")
                        return
            self.send_error(404)

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler
