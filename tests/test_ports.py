"""Tests for pipespec/commands/ports.py: `check_free` passes a free port and port 0, and refuses a port in
use at once with a ConfigError naming who would serve there, the address and the setting that chose it."""

from __future__ import annotations

import socket
import time

import pytest

from pipespec.commands.ports import check_free
from pipespec.errors import ConfigError
from tests.fixtures.ports import free_port


def test_a_free_port_and_port_0_pass():
    check_free("127.0.0.1", free_port(), "the coordinator", "server.port")  # bound and closed again: free
    check_free("127.0.0.1", 0, "the coordinator", "server.port")


def test_a_port_in_use_is_refused_naming_it():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        started = time.perf_counter()
        with pytest.raises(ConfigError) as refused:
            check_free("127.0.0.1", port, "the HTTP server", "--http-port")
        assert time.perf_counter() - started < 5  # a hang guard; it takes milliseconds
    assert str(refused.value) == (
        f"the HTTP server cannot serve on 127.0.0.1:{port}: Address already in use (--http-port; 0 picks a free port)"
    )
