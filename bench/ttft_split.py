"""Where a closed-loop request's time to first token goes, leg by leg, for each target of
one `bench/pool.py` closed-loop run: the load generator's request write, the synthetic
engine's start of generation and its first content, the client's first content; and,
for the traced port (`bench/variants/traced_port.py`), the port's own steps.

Every process stamps with `time.perf_counter()` (CLOCK_MONOTONIC, one clock for the
machine), so the legs join across processes.  The stamps come from a scratch copy with
`bench/variants/ttft_split.patch` applied (the benchmark itself stays unpatched):

    rm -rf /tmp/split && mkdir /tmp/split && git archive HEAD | tar -x -C /tmp/split
    (cd /tmp/split && patch -p1 < bench/variants/ttft_split.patch)
    rm -f /tmp/fake-times-*.txt /tmp/client-times.txt /tmp/traces-*.json
    (cd /tmp/split && $PWD/.venv/bin/python bench/pool.py --skip-pool --clients 64 \\
        --llama-tokens 0 --closed-rounds 1 \\
        --variant port-traced=bench/variants/traced_port.py) > /tmp/split.log 2>&1
    .venv/bin/python bench/ttft_split.py /tmp/split.log

A request is joined to the engine's stream that started first after it was written (the
agents' requests are tens of ms apart, the engine starts a stream within a few ms), so
the medians are right and single rows may not be.
"""

from __future__ import annotations

import bisect
import glob
import json
import re
import sys

STEPS = ("in", "gated", "up_write", "up_head", "up_first", "out")


def main(log_path: str) -> None:
    log = open(log_path).read()
    engine = re.search(r"engine pid \d+ on http://127\.0\.0\.1:(\d+)", log)
    if engine is None:
        raise SystemExit("no closed-loop engine in the log")
    names = {engine.group(1): "direct"}
    for name, port in re.findall(r"([\w-]+) pid \d+ on :(\d+)", log):
        names[port] = name
    streams = sorted(tuple(map(float, line.split()))
                     for path in glob.glob("/tmp/fake-times-*.txt") for line in open(path))
    starts = [start for start, _ in streams]
    asked: dict[str, list[tuple[float, float]]] = {}
    for line in open("/tmp/client-times.txt"):
        port, t_asked, t_first = line.split()
        asked.setdefault(names.get(port, port), []).append((float(t_asked), float(t_first)))

    print("target       requests  ttft   write→engine starts  engine start→first content  "
          "engine's first content→client   (p50 ms)")
    for name, rows in sorted(asked.items()):
        legs = []
        for t_asked, t_first in rows:
            i = bisect.bisect_left(starts, t_asked)
            if i < len(streams):
                start, first = streams[i]
                legs.append((t_first - t_asked, start - t_asked, first - start, t_first - first))
        print(f"{name:12} {len(legs):8}  " + "  ".join(
            f"{p50([leg[k] for leg in legs]):5.2f}" for k in range(4)))

    traces = [t for path in glob.glob("/tmp/traces-*.json") for t in json.load(open(path))
              if all(step in t for step in STEPS)]
    if not traces:
        return
    print(f"\nthe traced port, {len(traces)} requests (p50 ms):")
    for a, b in zip(STEPS, STEPS[1:]):
        print(f"  {a:>8} -> {b:<8} {p50([t[b] - t[a] for t in traces]):6.2f}")
    joined = [(t, streams[i]) for t in traces
              if (i := bisect.bisect_left(starts, t["up_write"])) < len(streams)]
    print(f"  up_write -> engine starts {p50([s[0] - t['up_write'] for t, s in joined]):6.2f}; "
          f"engine's first content -> up_first {p50([t['up_first'] - s[1] for t, s in joined]):6.2f}")
    clients = sorted(asked.get("port-traced", []))
    client_starts = [t_asked for t_asked, _ in clients]
    pairs = [(t, clients[i]) for t in traces
             if (i := bisect.bisect_right(client_starts, t["in"]) - 1) >= 0]
    print(f"  client writes -> in {p50([t['in'] - c[0] for t, c in pairs]):6.2f}; "
          f"out -> client reads {p50([c[1] - t['out'] for t, c in pairs]):6.2f}")


def p50(values: list[float]) -> float:
    values = sorted(values)
    return values[(len(values) - 1) // 2] * 1e3 if values else float("nan")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/split.log")
