"""The port on asyncio's own event loop instead of uvloop's (GGUF_STUDIO_EVENT_LOOP=asyncio),
to measure what uvloop gives: `bench/relay.py --variant port-asyncio=bench/variants/asyncio_loop_port.py`."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ["GGUF_STUDIO_EVENT_LOOP"] = "asyncio"

from backend.app.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
