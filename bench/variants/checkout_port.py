"""The port as another checkout has it (say main, beside a branch's change):
`BENCH_CHECKOUT=/path/to/checkout bench/relay.py --variant port-main=bench/variants/checkout_port.py`.

The checkout needs no install of its own: its `backend` is imported ahead of this
environment's (the editable install's finder comes after sys.path).  Only its Python
code differs; the packages are this environment's.  A snapshot that does not move during
the run, e.g. `git -C /work/main archive HEAD | tar -x -C /tmp/main-snapshot`, keeps the
comparison honest."""

import os
import sys
from pathlib import Path

checkout = Path(os.environ["BENCH_CHECKOUT"]).resolve()
sys.path.insert(0, str(checkout))

import backend  # noqa: E402

if not Path(backend.__file__).resolve().is_relative_to(checkout):
    raise SystemExit(f"backend came from {backend.__file__}, not from {checkout}")

try:  # the CLI's place since backend/ became rooms, then before
    from backend.app.cli import main
except ModuleNotFoundError:
    from backend.cli import main  # type: ignore[no-redef]

sys.exit(main(sys.argv[1:]))
