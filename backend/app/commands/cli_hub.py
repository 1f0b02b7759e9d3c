"""`gguf-studio search|pull|hf-token`: GGUF models on Hugging Face from the command line.

What the hub says is shown as plain text (`printable`): a repository's strings never
drive the terminal.  Downloads resume and are verified (`backend.models.download`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING, Any

from backend.errors import StudioError
from backend.models.hf_cache import printable

if TYPE_CHECKING:
    from backend.models.transfer_meter import TransferMeter

__all__ = ["add_hub_parsers"]


def add_hub_parsers(sub: Any) -> None:
    found = sub.add_parser("search", help="find GGUF repositories on Hugging Face")
    found.add_argument("text", nargs="*", help="words to look for (none: the curated coding models)")
    found.add_argument("--sort", choices=("downloads", "recent", "likes"), default="downloads")
    found.add_argument("--limit", type=int, default=20)
    found.set_defaults(run=_search)

    pull = sub.add_parser("pull", help="download a GGUF model into the Hugging Face cache")
    pull.add_argument("target", metavar="REPO[:QUANT|FILE]",
                      help="e.g. Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M")
    pull.add_argument("--context", type=int, default=8192,
                      help="context size the memory estimate assumes (default 8192)")
    pull.set_defaults(run=_pull)

    token = sub.add_parser("hf-token", help="save a Hugging Face token (read from the terminal or stdin)")
    token.add_argument("--forget", action="store_true", help="delete the saved token")
    token.set_defaults(run=_hf_token)


def _search(args: argparse.Namespace) -> int:
    from backend.models.hub import curated_models, search

    if not args.text:
        for model in curated_models():
            print(f"{model.repo_id:<48} {model.size:<7} {printable(model.name)}")
        return 0
    found = search(" ".join(args.text), sort=args.sort, limit=args.limit)
    if not found:
        print("No GGUF repositories match.", file=sys.stderr)
        return 1
    for repo in found:
        gated = "  (gated)" if repo.gated else ""
        print(f"{printable(repo.repo_id):<56} {repo.downloads:>10,} downloads  "
              f"{printable(repo.last_modified[:10])}{gated}")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from backend.llama.engine import detect_accelerators
    from backend.models.download import bytes_on_disk, download_model
    from backend.models.transfer_meter import TransferMeter
    from backend.models.fit import estimate_fit, machine_memory
    from backend.models.hub import list_repo, parse_pull_target, pick_choice

    repo_id, selector = parse_pull_target(args.target)
    listing = list_repo(repo_id)
    choice = pick_choice(listing, selector)
    fit = estimate_fit(choice.size, machine_memory(detect_accelerators().offload_memory()),
                       context=args.context,
                       repo_metadata=listing.gguf_metadata)
    parts = f" in {len(choice.files)} parts" if len(choice.files) > 1 else ""
    print(f"{printable(repo_id)}: {printable(choice.name)} ({printable(choice.quant) or 'unknown quantization'}, "
          f"{_size(choice.size)}{parts}) - {fit.verdict}", flush=True)
    print(f"  {fit.details()}", flush=True)
    meter = TransferMeter(bytes_on_disk(choice, listing.commit), choice.size)
    if meter.done:
        print(f"  resuming: {_size(meter.done)} already here", flush=True)
    bar = _TransferBar(meter)
    try:
        path = download_model(choice, listing.commit, on_bytes=bar.add, on_verifying=bar.verifying)
    except KeyboardInterrupt:
        bar.finish()
        print("Paused: run the same command again to resume.", file=sys.stderr)
        return 130
    bar.finish()
    print(printable(path, 4096))
    print(f"Ready: gguf-studio serve --model {shlex.quote(printable(path, 4096))}")
    return 0


def _hf_token(args: argparse.Namespace) -> int:
    import getpass

    from backend.models.hub import forget_token, save_token

    if args.forget:
        forget_token()
        print("The saved Hugging Face token is forgotten.")
        return 0
    token = getpass.getpass("Hugging Face token (input hidden): ").strip() if sys.stdin.isatty() \
        else sys.stdin.readline().strip()
    if not token:
        raise StudioError("No token given; nothing saved.")
    path = save_token(token)
    print(f"Saved to {path} (readable by you only). HF_TOKEN, when set, takes precedence.")
    return 0


class _TransferBar:
    """A bar on one line on a terminal; a line every 10 % otherwise (logs, CI)."""

    WIDTH = 30

    def __init__(self, meter: "TransferMeter") -> None:
        self.meter = meter
        self.tty = sys.stdout.isatty()
        self._last_tenth = -1.0
        self._last_draw = 0.0

    def add(self, n: int) -> None:
        import time

        self.meter.add(n)
        now = time.monotonic()
        if self.tty:
            if now - self._last_draw >= 0.1 or self.meter.done >= self.meter.total:
                self._last_draw = now
                sys.stdout.write("\r" + self._line())
                sys.stdout.flush()
        elif (tenth := self._fraction() * 10 // 1) != self._last_tenth:
            self._last_tenth = tenth
            print(self._line(), flush=True)

    def verifying(self) -> None:
        if self.tty:
            sys.stdout.write("\r" + self._line() + "  verifying SHA-256...")
            sys.stdout.flush()
        else:
            print("verifying SHA-256...", flush=True)

    def finish(self) -> None:
        if self.tty:
            print()

    def _fraction(self) -> float:
        return self.meter.done / self.meter.total if self.meter.total else 1.0

    def _line(self) -> str:
        from backend.models.transfer_meter import describe_duration

        fraction = min(self._fraction(), 1.0)
        filled = int(fraction * self.WIDTH)
        text = (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {fraction * 100:5.1f}% "
                f"{_size(self.meter.done)} / {_size(self.meter.total)}")
        if self.meter.speed > 0:
            text += f"  {_size(int(self.meter.speed))}/s"
            if self.meter.eta is not None:
                text += f"  {describe_duration(self.meter.eta)} left"
        return text


def _size(n: int) -> str:
    from backend.models.gguf_info import format_file_size

    return format_file_size(n)
