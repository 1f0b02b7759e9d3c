"""The RPC-workers setting: what a user may type, and what llama.cpp can reach."""

from __future__ import annotations

import pytest

from backend.errors import SettingsError
from backend.rpc_workers import DEFAULT_PORT, parse_rpc_worker, parse_rpc_workers


def test_workers_are_read_from_commas_spaces_or_a_list_and_a_missing_port_is_the_default():
    assert parse_rpc_workers("10.0.0.2:50052, Gpu-Box.lan:6000  10.0.0.3") == (
        "10.0.0.2:50052", "gpu-box.lan:6000", f"10.0.0.3:{DEFAULT_PORT}")
    assert parse_rpc_workers(["10.0.0.2:1"]) == ("10.0.0.2:1",)
    assert parse_rpc_workers("") == parse_rpc_workers(None) == ()


@pytest.mark.parametrize("typed, says", [
    ("[::1]:50052", "IPv4 only"),
    ("fe80::1", "IPv4 only"),
    (":50052", "has no host"),
    ("10.0.0.2:0", "port must be a number from 1 to 65535"),
    ("10.0.0.2:65536", "port must be a number from 1 to 65535"),
    ("10.0.0.2:http", "port must be a number"),
    ("10.0.0.300:50052", "not a host name or an IPv4 address"),
    ("bad_host!:50052", "not a host name or an IPv4 address"),
    ("10.0.0.2:50052,10.0.0.2:50052", "given twice"),
])
def test_a_worker_llama_cpp_cannot_reach_is_refused_with_the_reason(typed, says):
    with pytest.raises(SettingsError, match=says):
        parse_rpc_workers(typed)


@pytest.mark.parametrize("typed", ["h:²", "h:¹²³", "h:١٢٣", "h:５００５２", "h:+80", "h: 80"])
def test_a_port_of_other_than_ascii_digits_is_refused_readably_not_a_traceback(typed):
    with pytest.raises(SettingsError, match="the port must be a number from 1 to 65535"):
        parse_rpc_worker(typed)
