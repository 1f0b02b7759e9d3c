"""The relay benchmark's report: the markdown tables and the verdicts against the targets."""

from __future__ import annotations

from bench.scenarios import Scenario, Steady, median, quantile

TARGET_THROUGHPUT = 0.98
TARGET_TTFT_P50_MS = 2.0
TARGET_TTFT_P99_MS = 10.0


def _range(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "n/a"
    return (fmt.format(median(values)) + " (" + fmt.format(min(values)) + "–"
            + fmt.format(max(values)) + ")")


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def latency_table(scenarios: list[Scenario], judged: str = "port") -> tuple[list[str], list[str]]:
    """One row per scenario and relay; returns the rows and the verdict lines."""
    rows = ["| scenario | arrivals | streams × tokens | relay | throughput ÷ direct "
            "| direct TTFT p50 / p99 ms | added TTFT p50 ms | added TTFT p99 ms "
            "| relay CPU µs/chunk (sys) |",
            "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for s in scenarios:
        direct = s.runs["direct"]
        d50 = median([quantile(r.ttfts, 0.5) for r in direct]) * 1e3
        d99 = median([quantile(r.ttfts, 0.99) for r in direct]) * 1e3
        arrivals = f"over {s.spread:g} s" if s.spread else "at once"
        for name in s.runs:
            if name == "direct":
                continue
            ratios = s.throughput_ratios(name)
            p50 = [x * 1e3 for x in s.added_ttft(name, 0.5)]
            p99 = [x * 1e3 for x in s.added_ttft(name, 0.99)]
            rows.append(f"| {s.title} | {arrivals} | {s.streams} × {s.tokens} | {name} "
                        f"| {_range(ratios)} | {d50:.1f} / {d99:.1f} | {_range(p50, '{:+.1f}')} "
                        f"| {_range(p99, '{:+.1f}')} | {s.cpu_per_chunk(name, 'relay'):.0f} "
                        f"({s.cpu_per_chunk(name, 'relay_sys'):.0f}) |")
            if name == judged and s.judged:
                checks = [(f"throughput {median(ratios):.3f} ≥ {TARGET_THROUGHPUT}",
                           median(ratios) >= TARGET_THROUGHPUT),
                          (f"added TTFT p50 {median(p50):+.2f} ms ≤ {TARGET_TTFT_P50_MS:g}",
                           median(p50) <= TARGET_TTFT_P50_MS),
                          (f"added TTFT p99 {median(p99):+.2f} ms ≤ {TARGET_TTFT_P99_MS:g}",
                           median(p99) <= TARGET_TTFT_P99_MS)]
                verdicts.append(f"- {s.title}, {s.streams} streams, arrivals {arrivals}: "
                                + "; ".join(f"{text} {_mark(ok)}" for text, ok in checks))
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
    d50 = median([quantile(r.ttfts, 0.5) for r in direct]) * 1e3
    d99 = median([quantile(r.ttfts, 0.99) for r in direct]) * 1e3
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
        p50 = [x * 1e3 for x in s.added_ttft(name, 0.5)]
        p99 = [x * 1e3 for x in s.added_ttft(name, 0.99)]
        rows.append(f"| {name} | {_range(p50, '{:+.1f}')} | {_range(p99, '{:+.1f}')} "
                    f"| {s.cpu_per_chunk(name, 'relay'):.0f} "
                    f"({s.cpu_per_chunk(name, 'relay_sys'):.0f}) "
                    f"| {median([r.chunks for r in runs]):,.0f} "
                    f"| {median([r.counted / s.newcomers for r in runs]):.2f} |")
    return rows
