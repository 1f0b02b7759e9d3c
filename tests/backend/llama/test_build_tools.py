"""The tools a build runs, found on this machine or named with a remedy."""

from __future__ import annotations

import pytest

from backend.errors import BuildToolMissing
from backend.llama.build_tools import find_build_tools


def test_missing_compiler_is_named_with_a_remedy(tmp_path):
    with pytest.raises(BuildToolMissing, match="No C compiler found.*build-essential"):
        find_build_tools({"PATH": str(tmp_path)})
