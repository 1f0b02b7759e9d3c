"""The port with uvicorn's httptools protocol (llhttp) instead of h11 on the client side:
`bench/relay.py --variant port-httptools=bench/variants/httptools_port.py`.

httptools is deliberately not installed with the app or its extras (uvicorn would pick it
up by itself wherever it is importable); install it apart and point BENCH_EXTRA_PATH at it:
`pip install --target /tmp/bench-extra httptools==0.9.0`, `BENCH_EXTRA_PATH=/tmp/bench-extra`."""

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("BENCH_EXTRA_PATH"):
    sys.path.append(os.environ["BENCH_EXTRA_PATH"])

import httptools  # noqa: E402,F401  (fails here, clearly, when it is not installed)

from backend.port import server as gateway_server  # noqa: E402

gateway_server.uvicorn.Config = functools.partial(gateway_server.uvicorn.Config, http="httptools")

from backend.app.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
