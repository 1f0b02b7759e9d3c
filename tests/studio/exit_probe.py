"""Runs the real app, serves streams through its port while measuring the Qt loop's lag,
then quits the way a person does (closing the window).  Run as a child process by
test_exit_path.py: its exit code is the app's.

    python -m tests.studio.exit_probe MODEL STREAMS MAX_TOKENS

With PROBE_CHAT=1 (bench/qt_lag.py's default) the Chat tab is shown and streams answers
the whole time the streams pass (a new message whenever one ends), as a person chatting
beside the team's agents would; else the Activity tab is shown.

Prints one JSON line: the engine's pid, the answers' statuses and the lag percentiles
(and with PROBE_CHAT the Chat tab's answers and the characters it showed, and the CPU each
chat update took on the GUI thread); where the late ticks' time went (the GUI thread's
work, its wait for a core, the backend thread's work, the rest asleep), the collector's
passes, and the CPU the app, the engine, the clients and the machine used.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
from PySide6.QtCore import QObject, QTimer, Signal

from backend.llama.load import State
from studio.app import main
from studio.window import ACTIVITY_TAB, CHAT_TAB, MainWindow

TICK_MS = 10


class LagMeter(QObject):
    """How late a 10 ms timer fires on the Qt loop: the time the loop was busy elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.lags: list[float] = []
        # CPU the GUI thread itself spent between ticks: tells work on the Qt loop apart
        # from waiting (for the interpreter lock, or for a core on a busy machine).
        self.busy: list[float] = []
        self.spans: list[tuple[float, float]] = []
        self.sched: list[tuple[float, ...]] = []
        self._backend: int | None = None
        self._sched: tuple[int, ...] = (0, 0, 0)
        self._last = 0.0
        self._last_cpu = 0.0
        self._timer = QTimer(self)
        self._timer.setInterval(TICK_MS)
        self._timer.timeout.connect(self._tick)

    def start(self) -> None:
        self._backend = next((t.native_id for t in threading.enumerate()
                              if t.name == "gguf-studio-backend"), None)
        self._sched = self._schedstats()
        self._last = time.perf_counter()
        self._last_cpu = time.thread_time()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def _schedstats(self) -> tuple[int, ...]:
        """/proc's schedstat: ns on a core and ns waiting for one, of the GUI thread; ns on a
        core of the backend thread."""
        def read(tid: int | None) -> list[int]:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    return [int(x) for x in f.read().split()[:2]]
            except (OSError, ValueError):  # not Linux, or no such thread
                return [0, 0]
        gui = read(threading.get_native_id())
        return gui[0], gui[1], read(self._backend)[0]

    def late_ticks(self) -> dict:
        """Where the late ticks' (over 30 ms) time went, summed: the GUI thread's work,
        its wait for a core, the backend thread's work, and the rest (the GUI thread
        asleep: on the interpreter lock, or nothing to do)."""
        late = [(lag, s) for lag, s in zip(self.lags, self.sched) if lag > 30]
        total = sum(lag + TICK_MS for lag, _ in late)
        gui = sum(s[0] for _, s in late)
        queued = sum(s[1] for _, s in late)
        backend = sum(s[2] for _, s in late)
        return {"late_ms": round(total), "late_gui_cpu_ms": round(gui),
                "late_gui_runqueue_ms": round(queued), "late_backend_cpu_ms": round(backend),
                "late_gui_asleep_ms": round(total - gui - queued)}

    def _tick(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.lags.append(max(0.0, (now - self._last) * 1000 - TICK_MS))
        self.spans.append((self._last, now))
        sched = self._schedstats()
        # (GUI thread on a core, GUI thread waiting for a core, backend thread on a core), ms
        self.sched.append(tuple((a - b) / 1e6 for a, b in zip(sched, self._sched)))
        self._sched = sched
        self.busy.append((cpu - self._last_cpu) * 1000)
        self._last, self._last_cpu = now, cpu


class GcClock:
    """The garbage collector's passes in this process, timed: (generation, start, end)."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float, float]] = []
        self._began = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.passes.append((info["generation"], self._began, time.perf_counter()))

    def report(self, since: float, lags: list[tuple[float, float]]) -> dict:
        passes = [p for p in self.passes if p[1] >= since]
        full = [(p[2] - p[1]) * 1000 for p in passes if p[0] == 2]
        young = sorted((p[2] - p[1]) * 1000 for p in passes if p[0] < 2)
        # Late ticks (over 30 ms) whose wait covered a collection.
        late = [(start, end) for start, end in lags if (end - start) * 1000 - TICK_MS > 30]
        with_gc = sum(1 for start, end in late
                      if any(p[1] < end and p[2] > start for p in passes))
        every_full = [(p[2] - p[1]) * 1000 for p in self.passes if p[0] == 2]
        return {"gc_full": len(full), "gc_full_ms": [round(t, 1) for t in full],
                "gc_full_whole_run_ms": [round(t, 1) for t in every_full],
                "gc_full_at_s": [round(p[1] - since, 1) for p in self.passes if p[0] == 2],
                "gc_young": len(young), "gc_young_max_ms": round(young[-1], 1) if young else None,
                "late_ticks": len(late), "late_ticks_with_gc": with_gc}


GC_CLOCK = GcClock()


class Driver(QObject):
    traffic_done = Signal(object)

    def __init__(self, window: MainWindow, model: str, streams: int, max_tokens: int) -> None:
        super().__init__()
        self.window = window
        self.model = model
        self.streams = streams
        self.max_tokens = max_tokens
        self.meter = LagMeter()
        self.pid: int | None = None
        self._started = False
        self.traffic_done.connect(self._finish)
        window.bridge.snapshot_changed.connect(self._on_snapshot)
        self.chatting = os.environ.get("PROBE_CHAT") == "1"
        self.chat_answers = 0
        self._traffic_running = False
        self._sent_at = 0
        # The busiest views: the Chat tab streaming (PROBE_CHAT), or the chart redrawing
        # and the log following while streams pass.
        window.tabs.setCurrentIndex(CHAT_TAB if self.chatting else ACTIVITY_TAB)
        # The CPU the GUI thread spent in each chat update (the transcript's own work).
        self.draws: list[float] = []
        self.big_draws: list[tuple] = []
        show_turns = window.chat.transcript.show_turns

        def timed_show_turns(turns: tuple) -> None:
            began = time.thread_time()
            show_turns(turns)
            if self._traffic_running:
                took = (time.thread_time() - began) * 1000
                self.draws.append(took)
                last = turns[-1] if turns else None
                self.big_draws.append((round(took, 1), last.state.value if last else "",
                                       len(last.text) if last else 0, len(turns)))
        window.chat.transcript.show_turns = timed_show_turns  # type: ignore[method-assign]
        window.open_files([model])
        self._poll = QTimer(self)
        self._poll.timeout.connect(self._load_when_card_shown)
        self._poll.start(20)

    def _load_when_card_shown(self) -> None:
        if self.window.model_view.info is not None:
            self._poll.stop()
            self.window.model_view.parallel.setValue(4)
            # bench/qt_lag.py --engine-threads: 0 lets llama-server decide.
            self.window.model_view.threads.setValue(int(os.environ.get("PROBE_ENGINE_THREADS", "0")))
            self.window.load_selected()

    def _on_snapshot(self, snapshot) -> None:
        if snapshot.state is State.READY and not self._started:
            self._started = True
            self.pid = snapshot.pid
            if self.chatting:  # the traffic starts once the Chat tab's answer streams
                self._chat_poll = QTimer(self)
                self._chat_poll.timeout.connect(self._keep_chatting)
                self._chat_poll.start(20)
            else:
                self._start_traffic()

    def _start_traffic(self) -> None:
        self._traffic_running = True
        self.meter.start()
        threading.Thread(target=self._traffic, args=(self.window.settings.port,),
                         daemon=True).start()

    def _keep_chatting(self) -> None:
        chat = self.window.chat
        if chat.state.streaming:
            if not self._traffic_running and len(chat.transcript.toPlainText()) > self._sent_at + 100:
                self._start_traffic()  # the answer streams: the text grows
        elif chat.model.count() and chat.send_button.isEnabled() \
                and len(chat.state.turns) >= 2 * self.chat_answers:  # the last one came back
            self.chat_answers += 1
            chat.max_tokens.setValue(2000)
            chat.input.setPlainText(f"Tell me a long story, number {self.chat_answers}.")
            self._sent_at = len(chat.transcript.toPlainText()) + 60  # the question, the heading
            chat.send()

    def _traffic(self, port: int) -> None:
        self.cpu_before = _cpu_seconds(self.pid)
        # The clients run in a process of their own, as they would on other machines: in
        # this one they would compete with the window for the interpreter.
        done = subprocess.run(
            [sys.executable, "-m", "tests.studio.exit_probe", "--client",
             f"http://127.0.0.1:{port}/v1", str(self.streams), str(self.max_tokens)],
            capture_output=True, text=True, timeout=180)
        self.cpu_after = _cpu_seconds(self.pid)
        self.traffic_done.emit(json.loads(done.stdout) if done.returncode == 0 else [done.stderr])

    def _finish(self, statuses: list[int]) -> None:
        self.meter.stop()
        if self.chatting:
            self._chat_poll.stop()
        lags = sorted(self.meter.lags)
        busy = sorted(self.meter.busy)
        report: dict[str, Any] = {
            "busy_p99_ms": round(busy[min(len(busy) - 1, int(len(busy) * 0.99))], 2) if busy else None,
            "busy_max_ms": round(busy[-1], 2) if busy else None,
            "load_average": os.getloadavg()[0],
            "pid": self.pid,
            "statuses": statuses,
            "ticks": len(lags),
            "lag_p50_ms": round(statistics.median(lags), 2) if lags else None,
            "lag_p99_ms": round(lags[min(len(lags) - 1, int(len(lags) * 0.99))], 2) if lags else None,
            "lag_max_ms": round(lags[-1], 2) if lags else None,
            "backend_loop": type(self.window.bridge.backend_thread.loop).__module__,
        }
        cpu = {k: round(self.cpu_after[k] - self.cpu_before[k], 2) for k in self.cpu_before}
        report["cpu_s"] = cpu
        if self.meter.spans:
            report.update(GC_CLOCK.report(self.meter.spans[0][0], self.meter.spans))
            report.update(self.meter.late_ticks())
        if self.draws:
            draws = sorted(self.draws)
            report.update(draws=len(draws), draw_p50_ms=round(statistics.median(draws), 2),
                          draw_p99_ms=round(draws[int(len(draws) * 0.99)], 2),
                          draw_max_ms=round(draws[-1], 2),
                          biggest_draws=sorted(self.big_draws, reverse=True)[:6])
        if self.chatting:
            report["chat_answers"] = self.chat_answers
            report["chat_chars"] = len(self.window.chat.transcript.toPlainText())
        print(json.dumps(report), flush=True)
        # The probe answers the window's question itself (and prints it for the test).
        self.window.ask = self._answer_yes  # type: ignore[method-assign]
        self.window.close()

    def _answer_yes(self, title: str, text: str) -> bool:
        print(json.dumps({"asked": text}), flush=True)
        return True


def _cpu_seconds(engine: int | None) -> dict[str, float]:
    """CPU seconds so far: this app, the engine, the clients (children waited for), the
    whole machine's busy time, and the wall clock."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/{engine}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
    except (OSError, IndexError):  # not Linux
        fields, cpu = ["0"] * 13, [0] * 5
    return {"app": time.process_time(), "engine": (int(fields[11]) + int(fields[12])) / tick,
            "clients": resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
            + resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime,
            "machine": (sum(cpu) - cpu[3] - cpu[4]) / tick, "wall": time.perf_counter()}


async def streams(base_url: str, n: int, max_tokens: int) -> list[int]:
    body = {"model": "tiny", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Tell me a story"}]}

    async def one(client: httpx.AsyncClient) -> int:
        async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
            async for _line in response.aiter_lines():
                pass
            return response.status_code

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(n))))


def run(argv: list[str]) -> int:
    if argv[0] == "--client":
        print(json.dumps(asyncio.run(streams(argv[1], int(argv[2]), int(argv[3])))))
        return 0
    model, n, max_tokens = argv[0], int(argv[1]), int(argv[2])
    drivers: list[Driver] = []
    return main([], on_window=lambda window: drivers.append(Driver(window, model, n, max_tokens)))


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
