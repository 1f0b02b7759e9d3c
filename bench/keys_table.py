"""What the window's keys panel costs the port's event loop, refreshed once a second.

The panel asks the service for its table (every key with its usage) and chart (a key's
or every key's minutes over the last hour, 6 hours or day) every second while it is on
screen, and the service builds them on the backend loop, where the port runs.  Two ways,
side by side, on a ledger holding a full day of minutes for each key:

- **each time**: the chart's minutes summed afresh at every refresh;
- **service**: `StudioService.key_table`, which sums the minutes that are over once a
  minute and only the current minute's at every refresh (the first refresh of a minute
  costs what "each time" does; the figure is the mean of the other 59).

    .venv/bin/python bench/keys_table.py [--keys 5 50] [--repeat 30]

Not a test: nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.app.sharing.key_table import CHART_SPANS, key_table  # noqa: E402
from backend.app.service import StudioService  # noqa: E402
from backend.keys.usage import UsageLedger  # noqa: E402
from backend.settings import Settings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[5, 50])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print(f"{'keys':>4}  {'chart of':<9} {'span':<13} {'each time':>10} {'service':>9}  ratio")
        for keys in args.keys:
            os.environ["XDG_CONFIG_HOME"] = f"{folder}/{keys}"  # keys and usage of this run only
            run(keys, args.repeat, Path(folder) / f"{keys}")


def run(keys: int, repeat: int, folder: Path) -> None:
    now = time.time()
    clock = [now - 24 * 3600 + 60]
    ledger = UsageLedger(folder / "usage.json", clock=lambda: clock[0])
    service = StudioService(Settings(), log_dir=folder / "logs")
    names = [f"agent-{i}" for i in range(keys)]
    for name in names:
        service.keys.add(name)
    while clock[0] < now:  # a request a minute from every key, all day
        for name in names:
            ledger.record_wait(name, 0.2)
            ledger.record_request(name, 1500, 200)
        clock[0] += 60
    clock[0] = now
    service.usage = ledger
    records = service.keys.records()
    for chart_key in (None, names[0]):
        for span, label in CHART_SPANS:
            def each_time() -> None:
                key_table(records, ledger.snapshot(), ledger.series(chart_key),
                          owner_key_set=False, chart_key=chart_key, span=span, now=now)

            fresh = timed(each_time, repeat)
            service.key_table(chart_key, span, now=now)  # the minute's first refresh
            cached = timed(lambda: service.key_table(chart_key, span, now=now), repeat)
            who = "every key" if chart_key is None else "one key"
            print(f"{keys:>4}  {who:<9} {label:<13} {fresh * 1000:>8.1f} ms "
                  f"{cached * 1000:>6.2f} ms  {fresh / cached:>5.0f}x")


def timed(fn: object, repeat: int) -> float:
    assert callable(fn)
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


if __name__ == "__main__":
    main()
