"""Reading llama-server's output without a line limit, on a real pipe."""

from __future__ import annotations

import asyncio
import sys

from backend.llama.log import for_display, read_lines


async def lines_written_by(script: str, limit: int) -> list[str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script,
                                                stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    lines = [line async for line in read_lines(proc.stdout, limit)]
    await proc.wait()
    return lines


async def test_a_line_far_over_the_limit_is_cut_and_the_next_lines_still_arrive():
    script = "import sys; sys.stdout.write('a' * 300000 + '\\nafter\\n' + 'b' * 10 + '\\r\\nlast')"
    lines = await lines_written_by(script, limit=1000)
    assert lines == ["a" * 1000 + "… [299000 more bytes cut]", "after", "b" * 10, "last"]


def test_display_cuts_long_lines_and_says_how_much():
    assert for_display("x" * 10, limit=4) == "xxxx… [6 more characters]"
    assert for_display("short", limit=10) == "short"
