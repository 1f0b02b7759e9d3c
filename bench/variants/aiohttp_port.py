"""A port whose upstream leg is aiohttp's client (`bench/variants/upstream_aiohttp.py`) instead
of the hand-written one; `bench/relay.py --aiohttp` measures it as `port-aiohttp`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backend.port import gateway  # noqa: E402
from bench.variants.upstream_aiohttp import AiohttpUpstreamClient  # noqa: E402

gateway.UpstreamClient = AiohttpUpstreamClient

from backend.app.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
