"""The port without optimistic admission: every prompt above the byte bound's fair share
is counted before it is admitted, as before `Ticket.settle`, to measure what admitting on
the bound and counting meanwhile gives the first token:
`bench/relay.py --variant port-count-first=bench/variants/count_first_port.py`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backend.admission.line import Line  # noqa: E402

Line.fits_now = lambda self, need: False  # type: ignore[method-assign]

from backend.app.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
