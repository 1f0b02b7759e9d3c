"""The relay benchmark's report: the markdown tables and the verdicts against the targets."""

from __future__ import annotations

import os

from bench.load_generator import Run
from bench.pool_results import PoolResult, RealResult
from bench.scenarios import Scenario, Steady, median, quantile

TARGET_THROUGHPUT = 0.98
TARGET_TTFT_P50_MS = 2.0
TARGET_TTFT_P99_MS = 10.0
#: The pool's throughput: at least this share of N times one engine's.
TARGET_POOL_THROUGHPUT = 0.95


def machine_note() -> str:
    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return f"{os.cpu_count()} CPUs, load average at the end {load}"


def _range(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "n/a"
    return (fmt.format(median(values)) + " (" + fmt.format(min(values)) + "–"
            + fmt.format(max(values)) + ")")


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _direct_ms(s: Scenario | Steady) -> tuple[float, float]:
    """The direct runs' TTFT p50 and p99, ms: medians over rounds."""
    direct = s.runs["direct"]
    return (median([quantile(r.ttfts, 0.5) for r in direct]) * 1e3,
            median([quantile(r.ttfts, 0.99) for r in direct]) * 1e3)


def _added_ms(s: Scenario | Steady, name: str) -> tuple[list[float], list[float]]:
    """What `name` added to the TTFT p50 and p99 over direct, ms, one a round."""
    return [x * 1e3 for x in s.added_ttft(name, 0.5)], [x * 1e3 for x in s.added_ttft(name, 0.99)]


def _relay_cpu(s: Scenario | Steady, name: str) -> str:
    """`name`'s relay CPU µs a chunk, and its system part."""
    return f"{s.cpu_per_chunk(name, 'relay'):.0f} ({s.cpu_per_chunk(name, 'relay_sys'):.0f})"


def _ttft_checks(p50: list[float], p99: list[float]) -> list[tuple[str, bool]]:
    """The added TTFT's medians against their targets."""
    return [(f"added TTFT p50 {median(p50):+.2f} ms ≤ {TARGET_TTFT_P50_MS:g}",
             median(p50) <= TARGET_TTFT_P50_MS),
            (f"added TTFT p99 {median(p99):+.2f} ms ≤ {TARGET_TTFT_P99_MS:g}",
             median(p99) <= TARGET_TTFT_P99_MS)]


def _verdict(head: str, checks: list[tuple[str, bool]]) -> str:
    return head + "; ".join(f"{text} {_mark(ok)}" for text, ok in checks)


def latency_table(scenarios: list[Scenario], judged: str = "port") -> tuple[list[str], list[str]]:
    """One row per scenario and relay; returns the rows and the verdict lines."""
    rows = ["| scenario | arrivals | streams × tokens | relay | throughput ÷ direct "
            "| direct TTFT p50 / p99 ms | added TTFT p50 ms | added TTFT p99 ms "
            "| relay CPU µs/chunk (sys) |",
            "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for s in scenarios:
        d50, d99 = _direct_ms(s)
        arrivals = f"over {s.spread:g} s" if s.spread else "at once"
        for name in s.runs:
            if name == "direct":
                continue
            ratios = s.throughput_ratios(name)
            p50, p99 = _added_ms(s, name)
            rows.append(f"| {s.title} | {arrivals} | {s.streams} × {s.tokens} | {name} "
                        f"| {_range(ratios)} | {d50:.1f} / {d99:.1f} | {_range(p50, '{:+.1f}')} "
                        f"| {_range(p99, '{:+.1f}')} | {_relay_cpu(s, name)} |")
            if name == judged and s.judged:
                checks = [(f"throughput {median(ratios):.3f} ≥ {TARGET_THROUGHPUT}",
                           median(ratios) >= TARGET_THROUGHPUT), *_ttft_checks(p50, p99)]
                verdicts.append(_verdict(f"- {s.title}, {s.streams} streams, arrivals "
                                         f"{arrivals}: ", checks))
    return rows, verdicts


def saturation_table(s: Scenario) -> list[str]:
    rows = [f"Saturation: {s.streams} streams × {s.tokens} tokens at once, no delay, "
            f"{len(s.runs['direct'])} rounds (CPU per relayed chunk: utime+stime of each process)",
            "",
            "| relay | chunks/s | ÷ direct | relay CPU µs/chunk (sys) "
            "| upstream CPU µs/chunk | client CPU µs/chunk |",
            "|---|---|---|---|---|---|"]
    for name in s.runs:
        rates = [r.rate for r in s.runs[name]]
        ratio = "1" if name == "direct" else _range(s.throughput_ratios(name))
        relay_cpu = "—" if name == "direct" else (f"{s.cpu_per_chunk(name, 'relay'):.1f} "
                                                  f"({s.cpu_per_chunk(name, 'relay_sys'):.1f})")
        rows.append(f"| {name} | {median(rates):,.0f} | {ratio} | {relay_cpu} "
                    f"| {s.cpu_per_chunk(name, 'upstream'):.1f} "
                    f"| {s.cpu_per_chunk(name, 'client'):.1f} |")
    return rows


def steady_table(s: Steady) -> list[str]:
    direct = s.runs["direct"]
    d50, d99 = _direct_ms(s)
    rows = [f"Steady state: a newcomer (prompt {s.prompt_label}) arrives every {s.interval * 1e3:g}–"
            f"{s.interval * 1.5e3:g} ms ({s.newcomers} per round, 2 tokens each) while "
            f"{s.background} streams flow at one token per {s.delay * 1e3:g} ms; "
            f"{len(direct)} rounds; direct newcomer TTFT p50 / p99 {d50:.1f} / {d99:.1f} ms; "
            "CPU per paced chunk = relay CPU from the first arrival to the last newcomer's "
            "end ÷ content chunks relayed meanwhile",
            "",
            "| relay | newcomer added TTFT p50 ms | newcomer added TTFT p99 ms "
            "| relay CPU µs per paced chunk (sys) | chunks per round "
            "| upstream counting calls per newcomer |",
            "|---|---|---|---|---|---|"]
    for name, runs in s.runs.items():
        if name == "direct":
            continue
        p50, p99 = _added_ms(s, name)
        rows.append(f"| {name} | {_range(p50, '{:+.1f}')} | {_range(p99, '{:+.1f}')} "
                    f"| {_relay_cpu(s, name)} "
                    f"| {median([r.chunks for r in runs]):,.0f} "
                    f"| {median([r.counted / s.newcomers for r in runs]):.2f} |")
    return rows


# --- bench/pool.py -------------------------------------------------------------------------


def pool_throughput_table(pool: list[PoolResult], slots: int, tokens: int, delay: float | None,
                          judged: bool = True) -> tuple[list[str], list[str]]:
    """One row per pool size N: the port's rate against N times one engine's and against
    going directly to every engine.  `delay` None: a real engine, at its own pace."""
    pace = f"at one token per {delay * 1e3:g} ms" if delay is not None else "at the engines' pace"
    rows = [f"Pool throughput: {slots}N streams × {tokens} tokens {pace}, all at once, through "
            f"the port over N engines of {slots} slots; against {slots} streams on one engine "
            f"alone and {slots} on each engine directly; medians over rounds of per-round "
            "ratios, (min–max)",
            "",
            "| engines | streams | one engine chunks/s | direct chunks/s | port chunks/s "
            "| port ÷ (N × one engine) | direct ÷ (N × one engine) | port ÷ direct "
            "| requests that waited at an engine (port / direct) | port CPU µs/chunk (sys) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for p in pool:
        runs = p.throughput
        one, port, direct = runs["one engine"], runs["port"], runs["direct"]
        vs_one = [a.rate / (p.engines * b.rate) for a, b in zip(port, one) if b.rate]
        direct_vs_one = [a.rate / (p.engines * b.rate) for a, b in zip(direct, one) if b.rate]
        vs_direct = [a.rate / b.rate for a, b in zip(port, direct) if b.rate]
        cpu = median([r.cpu["relay"] / r.chunks * 1e6 for r in port if r.chunks])
        sys_cpu = median([r.cpu["relay_sys"] / r.chunks * 1e6 for r in port if r.chunks])
        waited = f"{p.waited['port']} / {p.waited['direct']}" if delay is not None else "—"
        rows.append(f"| {p.engines} | {slots * p.engines} | {median([r.rate for r in one]):,.0f} "
                    f"| {median([r.rate for r in direct]):,.0f} "
                    f"| {median([r.rate for r in port]):,.0f} | {_range(vs_one)} "
                    f"| {_range(direct_vs_one)} | {_range(vs_direct)} | {waited} "
                    f"| {cpu:.0f} ({sys_cpu:.0f}) |")
        if judged:
            ok = median(vs_one) >= TARGET_POOL_THROUGHPUT
            verdicts.append(f"- pool of {p.engines}, throughput {median(vs_one):.3f} × N × one "
                            f"engine's ≥ {TARGET_POOL_THROUGHPUT} {_mark(ok)}")
    return rows, verdicts


def pool_newcomer_table(pool: list[PoolResult], slots: int) -> tuple[list[str], list[str]]:
    first = next((p.steady for p in pool if p.steady is not None), None)
    if first is None:
        return [], []
    rows = [f"Pool newcomers: {slots}N−1 streams flow at one token per {first.delay * 1e3:g} ms; "
            f"a newcomer ({first.newcomer_tokens} tokens) arrives every {first.interval * 1e3:g}–"
            f"{first.interval * 1.5e3:g} ms ({first.newcomers} per round) and takes the one "
            "free slot; direct = straight to the engine with the free slot; added = port − "
            "direct within a round, median over rounds (min–max)",
            "",
            "| engines | busy streams | direct newcomer TTFT p50 / p99 ms | added TTFT p50 ms "
            "| added TTFT p99 ms | port CPU µs per paced chunk (sys) |",
            "|---|---|---|---|---|---|"]
    verdicts = []
    for p in pool:
        s = p.steady
        if s is None:
            continue
        d50, d99 = _direct_ms(s)
        p50, p99 = _added_ms(s, "port")
        rows.append(f"| {p.engines} | {s.background} | {d50:.1f} / {d99:.1f} "
                    f"| {_range(p50, '{:+.1f}')} | {_range(p99, '{:+.1f}')} "
                    f"| {_relay_cpu(s, 'port')} |")
        verdicts.append(_verdict(f"- pool of {p.engines}, newcomer: ", _ttft_checks(p50, p99)))
    return rows, verdicts


def routing_table(routing: dict[int, float], pool: list[PoolResult], slots: int) -> list[str]:
    port_cpu = {p.engines: median(p.port_cpu_per_request) for p in pool if p.port_cpu_per_request}
    rows = ["Routing CPU per request: the admission decision alone (a request finding the one "
            f"free slot among N engines of {slots} busy slots, and its release; in this "
            "process, `backend.admission.line`), and the port process's whole CPU per "
            f"one-token request ({slots}N agents on kept-alive connections; HTTP in and out, "
            "parsing, admission, the upstream request; utime+stime from /proc)",
            "",
            "| engines | admission decision µs/request | port CPU µs per short request |",
            "|---|---|---|"]
    for n, seconds in routing.items():
        whole = f"{port_cpu[n] * 1e6:.0f}" if n in port_cpu else "—"
        rows.append(f"| {n} | {seconds * 1e6:.1f} | {whole} |")
    return rows


def closed_loop_table(s: Scenario, judged: bool = True) -> tuple[list[str], list[str]]:
    direct = s.runs["direct"]
    d50, d99 = _direct_ms(s)
    rows = [f"{s.title}: {s.streams} agents, each sending {s.requests} requests of "
            f"{s.tokens} tokens one after the other on its kept-alive connection (the next the "
            "moment the last answer ended), connecting over "
            f"{s.spread:g} s; TTFT of the requests on a kept-alive connection (the second on); "
            f"{len(direct)} rounds; direct TTFT p50 / p99 {d50:.1f} / {d99:.1f} ms; added = "
            "relay − direct within a round, median over rounds (min–max); arrival spread = "
            "how far apart the agents' k-th requests were written (last − first, k ≥ 2), "
            "median",
            "",
            "| relay | throughput ÷ direct | added TTFT p50 ms | added TTFT p99 ms "
            "| relay CPU µs/chunk (sys) | requests measured per round (on a new connection: "
            "relay / direct) | arrival spread ms |",
            "|---|---|---|---|---|---|---|"]
    verdicts = []
    for name in s.runs:
        if name == "direct":
            continue
        p50, p99 = _added_ms(s, name)
        rows.append(f"| {name} | {_range(s.throughput_ratios(name))} | {_range(p50, '{:+.1f}')} "
                    f"| {_range(p99, '{:+.1f}')} | {_relay_cpu(s, name)} "
                    f"| {median([len(r.ttfts) for r in s.runs[name]]):.0f} "
                    f"({median([r.reconnected for r in s.runs[name]]):.0f} / "
                    f"{median([r.reconnected for r in direct]):.0f}) "
                    f"| {_spread_ms(s.runs[name])} |")
        if judged and name == "port":
            verdicts.append(_verdict(f"- closed loop, {s.streams} agents: ",
                                     _ttft_checks(p50, p99)))
    return rows, verdicts


#: The burst's aim: at most this much of the port's serial work per request, so at most
#: agents × this added to the first token (issue 34: 100 µs, 6.4 ms at 64 agents).
TARGET_SERIAL_MS_PER_REQUEST = 0.1


def burst_table(s: Scenario) -> tuple[list[str], list[str]]:
    direct = s.runs["direct"]
    d50, d99 = _direct_ms(s)
    rows = [f"{s.title}: {s.streams} agents in lockstep, each on its kept-alive connection, "
            f"every agent's request ({s.tokens} tokens) written in the same loop turn and the "
            f"next burst the moment the last answer ended; {s.requests} measured bursts per "
            f"round after one that opens the connections; {len(direct)} rounds; direct TTFT "
            f"p50 / p99 {d50:.1f} / {d99:.1f} ms; added = relay − direct within a round, median "
            "over rounds (min–max); serial CPU = the relay's CPU (every thread, scheduler "
            "clock) from a burst's first write to its last first token ÷ agents, median over "
            "bursts",
            "",
            "| relay | throughput ÷ direct | added TTFT p50 ms | added TTFT p99 ms "
            "| added p50 ÷ agents µs | serial CPU µs/request | relay CPU µs/chunk (sys) "
            "| arrival spread ms |",
            "|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for name in s.runs:
        if name == "direct":
            continue
        p50, p99 = _added_ms(s, name)
        serial = [cpu / s.streams * 1e6 for r in s.runs[name] for cpu in r.first_token_cpu]
        rows.append(f"| {name} | {_range(s.throughput_ratios(name))} | {_range(p50, '{:+.1f}')} "
                    f"| {_range(p99, '{:+.1f}')} | {median(p50) / s.streams * 1e3:.0f} "
                    f"| {_range(serial, '{:.0f}') if serial else '—'} "
                    f"| {_relay_cpu(s, name)} | {_spread_ms(s.runs[name])} |")
        if name == "port":
            aim = TARGET_SERIAL_MS_PER_REQUEST * s.streams
            verdicts.append(f"- burst, {s.streams} agents: added TTFT p50 {median(p50):+.2f} ms "
                            f"≤ {aim:g} ({TARGET_SERIAL_MS_PER_REQUEST * 1e3:g} µs × "
                            f"{s.streams}) {_mark(median(p50) <= aim)}")
    return rows, verdicts


def _spread_ms(runs: list[Run]) -> str:
    spreads = [x * 1e3 for r in runs for x in r.arrival_spread]
    return f"{median(spreads):.1f}" if spreads else "—"


def real_engine_tables(real: RealResult, slots: int, tokens: int) -> list[str]:
    rows, _ = pool_throughput_table(real.pool, slots, tokens, None, judged=False)
    out = [f"{real.title} (not judged: see the docstring of bench/pool.py)", "", *rows]
    if real.closed is not None:
        closed, _ = closed_loop_table(real.closed, judged=False)
        out += ["", *closed]
    return out
