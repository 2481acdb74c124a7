"""Whether a port can be bound here, checked before a command starts anything.

`pipespec serve` (and `python -m pipespec.cluster.launch`) bind the coordinator's gRPC port and, with
`--http-port`, an HTTP port, on the launcher's node. Starting Ray and loading models takes seconds
before those servers bind; `check_server_ports` tries each port first, so that a port in use is refused
at once, naming it. A port taken between the check and the bind is still the servers' own error.
"""

from __future__ import annotations

import socket

from pipespec.errors import ConfigError


def check_free(host: str, port: int, what: str, key: str) -> None:
    """ConfigError naming `what` (who would serve there), host:port, the reason and `key` (the setting
    that chose the port) if host:port cannot be bound here now. Port 0 (any free one) always can."""
    if port == 0:
        return
    try:
        family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and uvicorn bind
            probe.bind(where)
    except OSError as e:
        raise ConfigError(f"{what} cannot serve on {host}:{port}: {e.strerror or e} ({key}; 0 picks a free port)") from None


def check_server_ports(host: str, port: int, port_key: str, http_host: str | None, http_port: int | None) -> None:
    """The coordinator's gRPC at host:port (`port_key`: the setting that chose it) and the HTTP server's
    (None: none; its host None: the coordinator's) can serve here, on two addresses; ConfigError naming the port."""
    check_free(host, port, "the coordinator", port_key)
    if http_port is None:
        return
    http_host = host if http_host is None else http_host
    if http_port != 0 and (http_host, http_port) == (host, port):
        raise ConfigError(f"the HTTP server and the coordinator's gRPC cannot share {http_host}:{http_port} (--http-port)")
    check_free(http_host, http_port, "the HTTP server", "--http-port")
