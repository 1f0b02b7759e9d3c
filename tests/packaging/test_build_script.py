"""packaging/build.py's reuse rule: a new bundle exactly when an input changed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_build():
    spec = importlib.util.spec_from_file_location("gguf_studio_build", ROOT / "packaging" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load_build()


def make_checkout(root: Path) -> None:
    for name in ("packaging/gguf-studio.spec", "packaging/build.py", "packaging/entry.py",
                 "pyproject.toml", "backend/app/service.py", "studio/app.py", "resources/icon.svg"):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)


def test_digest_follows_sources_spec_and_resources(tmp_path):
    make_checkout(tmp_path)
    first = build.inputs_digest(tmp_path)
    assert build.inputs_digest(tmp_path) == first  # stable

    (tmp_path / "backend" / "__pycache__").mkdir()
    (tmp_path / "backend" / "__pycache__" / "service.cpython-311.pyc").write_bytes(b"x")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "anything").write_text("x")
    assert build.inputs_digest(tmp_path) == first  # caches and outputs do not count

    for name in ("backend/app/service.py", "studio/app.py", "resources/icon.svg",
                 "packaging/gguf-studio.spec", "pyproject.toml"):
        path = tmp_path / name
        path.write_text(path.read_text() + " changed")
        changed = build.inputs_digest(tmp_path)
        assert changed != first, name
        first = changed

    (tmp_path / "studio" / "new_view.py").write_text("")
    assert build.inputs_digest(tmp_path) != first  # a new file counts too


def test_up_to_date_needs_the_stamp_and_the_executable(tmp_path):
    dist = tmp_path / "dist"
    exe = build.executable_path(dist)
    assert not build.is_up_to_date(dist, "abc")
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert not build.is_up_to_date(dist, "abc")  # no stamp: an interrupted build
    (dist / build.STAMP_NAME).write_text("abc\n")
    assert build.is_up_to_date(dist, "abc")
    assert not build.is_up_to_date(dist, "def")


def test_bundle_size_counts_linked_libraries_once(tmp_path):
    (tmp_path / "lib.so").write_bytes(b"x" * 1000)
    (tmp_path / "alias.so").symlink_to("lib.so")
    assert build.bundle_size(tmp_path) == 1000
