"""Admission's CPU per request, this checkout against another, side by side.

    python bench/admission_cpu.py --against /tmp/main-snapshot     # e.g. a git archive
    python bench/admission_cpu.py --against /tmp/snap --quick

Two figures per request, each in a fresh process per round, the two checkouts one after
the other (A B A B ...), medians over the rounds of per-round ratios (this machine is
small and shared: the side-by-side ratio means more than the microseconds):

- the decision: `Line.request` of a request that finds the one free slot among N engines
  of 4 busy slots, and its release (as `bench/pool.py`'s routing_cpu);
- the decision with its key's flow: the same with a named key that has token limits —
  its flow, its reservation, its rate-limit headers, its admission and answer booked,
  started and finished (the relay's calls to flow control for one request).

The other checkout needs no install: its `backend` is imported ahead of this environment's
(packages are this environment's).  Checkouts from before the admission room (modules in
`backend/port/`) and from before the flow pass are measured through the same calls they
had then.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SLOTS = 4
POOL_CTX = 4 * 4096


def measure(engines: int, iterations: int) -> dict[str, float]:
    """Seconds of CPU per request in this process, for the checkout first on sys.path."""
    from backend.llama.kv_capacity import KvCapacity, TokenNeed
    from backend.llama.load import Serving
    from backend.keys.key_store import KeyStore
    try:
        from backend.admission.admission_registry import AdmissionRegistry
        from backend.admission import flow_control
        from backend.admission.caller import Caller
        from backend.admission.rate_limits import RateLimiter
    except ModuleNotFoundError:
        from backend.port.admission_registry import AdmissionRegistry  # type: ignore[no-redef]
        from backend.port import flow_control  # type: ignore[no-redef]
        from backend.port.access_guard import Caller  # type: ignore[no-redef,attr-defined]
        from backend.port.rate_limits import RateLimiter  # type: ignore[no-redef]

    registry = AdmissionRegistry()
    for i in range(engines):
        registry.activate(Serving(f"http://127.0.0.1:{9000 + i}", SLOTS,
                                  kv=KvCapacity.shared(POOL_CTX)), model="m", engine=f"e{i}")
    line = registry.line("m")
    need = TokenNeed(40, 2048)
    busy = [line.request(need) for _ in range(SLOTS * engines - 1)]

    started = time.process_time()
    for _ in range(iterations):
        line.request(need).release()
    decision = (time.process_time() - started) / iterations

    with tempfile.TemporaryDirectory() as home:  # never the user's own keys file
        store = KeyStore(Path(home) / "keys.json")
        store.add("agent", tokens_per_minute=10**12, tokens_per_day=10**15)
    caller = Caller("agent", store.get("agent"))
    flows = flow_control.FlowControl(RateLimiter())
    request: Any = object()
    passing = hasattr(flows, "enter")
    started = time.process_time()
    for _ in range(iterations):
        if passing:
            passage = flows.enter(caller, "m")
            passage.start(request)
            passage.reserve(need.total)
            ticket = line.request(need, flow=passage.flow)
            passage.headers()
            passage.admitted(0.0)
            ticket.release()
            passage.answered((40, 20))
            passage.close()
        else:
            flows.check_model(caller, "m")
            flows.started(caller, request)
            reservation = flows.reserve(caller, need.total)
            ticket = line.request(need, flow=flows.flow_of(caller))
            flows.headers(caller)
            flows.admitted(caller, 0.0)
            ticket.release()
            flows.answered(caller, reservation, (40, 20))
            flows.finished(caller, request)
    with_flow = (time.process_time() - started) / iterations
    for ticket in busy:
        ticket.release()
    return {"decision": decision, "with_flow": with_flow}


def child(checkout: str, engines: int, iterations: int) -> None:
    sys.path.insert(0, checkout)
    import backend
    if not Path(backend.__file__).resolve().is_relative_to(Path(checkout).resolve()):
        raise SystemExit(f"backend came from {backend.__file__}, not from {checkout}")
    print(json.dumps(measure(engines, iterations)))


def run_child(checkout: Path, engines: int, iterations: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", str(checkout), str(engines),
                          str(iterations)], check=True, capture_output=True, text=True,
                         cwd="/")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="the other checkout (say main before)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iterations", type=int, default=40_000)
    parser.add_argument("--engines", type=int, nargs="*", default=[1, 2, 4, 16])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return 0
    if args.against is None:
        parser.error("--against CHECKOUT is needed")
    if args.quick:
        args.rounds, args.iterations = 3, 10_000
    print(f"admission CPU per request, this checkout ({REPO}) against {args.against}: "
          f"{args.rounds} rounds of {args.iterations} requests, each in a fresh process")
    print(f"{'engines':>7}  {'figure':<10} {'this µs':>8} {'other µs':>9} {'this/other':>10}")
    for engines in args.engines:
        figures: dict[str, dict[str, list[float]]] = {}
        for _ in range(args.rounds):
            this = run_child(REPO, engines, args.iterations)
            other = run_child(args.against, engines, args.iterations)
            for name in this:
                entry = figures.setdefault(name, {"this": [], "other": [], "ratio": []})
                entry["this"].append(this[name])
                entry["other"].append(other[name])
                entry["ratio"].append(this[name] / other[name])
        for name, entry in figures.items():
            print(f"{engines:>7}  {name:<10} {statistics.median(entry['this']) * 1e6:>8.2f} "
                  f"{statistics.median(entry['other']) * 1e6:>9.2f} "
                  f"{statistics.median(entry['ratio']):>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
