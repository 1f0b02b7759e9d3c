"""The C heap gives a large freed block back to the system (glibc), in a fresh process
each: without the fixed threshold, glibc keeps what a 16 MiB body took."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Prints the resident MiB a process keeps after making and freeing 16 MiB blocks, as
#: a port does reading large request bodies one after another.
PROBE = """
import sys
from backend.heap import return_large_blocks
if sys.argv[1] == "fixed":
    assert return_large_blocks()
def resident():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("VmRSS:")) // 1024
before = resident()
for n in range(8):
    body = bytes([n]) * (16 << 20)
    del body
print(resident() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_a_freed_large_block_goes_back_to_the_system():
    kept = {mode: int(subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, check=True,
                                     capture_output=True, text=True).stdout)
            for mode in ("glibc's own", "fixed")}
    assert kept["glibc's own"] >= 16 and kept["fixed"] < 4, kept

