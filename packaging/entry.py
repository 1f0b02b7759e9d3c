"""The bundle's entry point: the window, `--self-test MODEL`, or the desktop entry.

    gguf-studio                                   open the window (studio.app.main)
    gguf-studio --self-test MODEL [--llama-server PATH] [--timeout S]
                                                  load MODEL, answer one request through
                                                  the app's own port, exit 0 on success
    gguf-studio --install-desktop | --uninstall-desktop [--data-home DIR]
                                                  (Linux) add this bundle to the desktop's
                                                  application menu, or remove it

The self-test uses the window's `studio.app.self_test(model, llama_server=...)` when the
window module provides one (it shows the window offscreen while the test runs), and the
headless `backend.app.self_test` otherwise.  Everything is imported lazily, so that the
self-test of a bundle works even where Qt cannot start.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _has_flag(argv, "--self-test"):
        return _self_test(argv)
    if _has_flag(argv, "--install-desktop") or _has_flag(argv, "--uninstall-desktop"):
        return _desktop_entry(argv)
    try:
        from studio.app import main as open_window
    except ImportError as exc:
        print(f"gguf-studio: this build cannot open its window ({exc}).", file=sys.stderr)
        return 1
    return open_window()


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _self_test(argv: list[str]) -> int:
    from backend.app import self_test as headless

    parser = argparse.ArgumentParser(prog="gguf-studio")
    parser.add_argument("--self-test", metavar="MODEL", required=True,
                        help="load MODEL, answer one request through the port, exit")
    headless.add_arguments(parser)
    args, _unknown = parser.parse_known_args(argv)  # Qt's own options may follow

    window_test = _window_self_test()
    if window_test is not None:
        return window_test(args.self_test, llama_server=args.llama_server)
    import asyncio

    return asyncio.run(headless.run_self_test(args.self_test, llama_server=args.llama_server,
                                              ctx_size=args.ctx_size, timeout=args.timeout))


def _window_self_test():
    """`studio.app.self_test` when the window module has one, else None."""
    try:
        from studio import app
    except ImportError:
        return None
    fn = getattr(app, "self_test", None)
    return fn if callable(fn) else None


def _desktop_entry(argv: list[str]) -> int:
    from backend.app import desktop_entry

    parser = argparse.ArgumentParser(prog="gguf-studio")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--install-desktop", action="store_true",
                        help="add this app to the desktop's application menu")
    action.add_argument("--uninstall-desktop", action="store_true",
                        help="remove it from the menu again")
    desktop_entry.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.install_desktop:
        return desktop_entry.cli_install(args)
    return desktop_entry.cli_uninstall(args)


if __name__ == "__main__":
    sys.exit(main())
