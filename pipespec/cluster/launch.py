"""Serve a pipeline on a Ray cluster: the `ray job submit` entrypoint, and `pipespec serve`.

    ray job submit --working-dir . -- python -m pipespec.cluster.launch CONFIG [--host H] [--port P] [--strategy pack|spread]
                                      [--http-port N [--http-host H] [--allowed-local-media-path DIR]] [--log-level LEVEL]
    pipespec serve CONFIG [--address RAY_ADDRESS]        # a local Ray unless --address

Prints the address clients connect to (`pipespec generate --address ...`, `Client(address)`) and,
with `--http-port`, the URL of the OpenAI-compatible HTTP server beside it (without: none), then
serves until stopped (Ctrl-C, SIGTERM, `ray job stop`), removing its actors and placement group.
The host and port default to the config's `server` section (loopback unless it says otherwise); the
HTTP server binds `--http-host`, else the coordinator's host. A config, strategy, port or placement
the pipeline cannot start with is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipespec.cluster.actors import HttpSpec
from pipespec.cluster.bundles import STRATEGIES
from pipespec.cluster.pipeline import ray_env, start_pipeline
from pipespec.config import ConfigError, load_config
from pipespec.commands.examples import config_path
from pipespec.commands.logs import LoggingConfigError, add_log_level, setup_logging


def serve(
    config_arg: str | Mapping[str, Any],
    ray_address: str | None,
    host: str | None,
    port: int | None,
    strategy: str,
    http_port: int | None = None,
    http_host: str | None = None,
    allowed_media: str | None = None,
) -> int:
    """Serve `config_arg` (a config file, a shipped example's name, or a parsed config) until stopped.
    `host`, `port`: where clients connect (None: the config's server.host, server.port); `http_port`:
    serve OpenAI-compatible HTTP there too (None: no HTTP server), on `http_host` (None: `host`),
    reading `image_url` file paths under `allowed_media` only (None: none)."""
    ray_env()
    import ray

    try:
        config = load_config(config_path(config_arg) if isinstance(config_arg, str) else config_arg)
        http = _http(http_port, http_host, allowed_media)
    except ConfigError as e:
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
    if ray_address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(address="local", include_dashboard=False)  # a Ray of our own on this machine
    else:
        ray.init(address=ray_address)  # the cluster we were submitted to (RAY_ADDRESS) or asked for
    try:
        running = start_pipeline(config, host=host, port=port, strategy=strategy, http=http)
    except ConfigError as e:  # nothing left running: start_pipeline cleans up after itself
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
    if running.http_address is not None:  # before the line that says it is serving, the last one
        print(f"pipespec: OpenAI-compatible HTTP at {running.http_address}", flush=True)
    print(f"pipespec: serving {config.name!r} ({len(config.stages)} stages) at {running.address}", flush=True)
    failures: list[str] = []

    async def wait() -> None:
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def failed(why: str) -> None:  # on the supervisor's thread
            failures.append(why)
            loop.call_soon_threadsafe(stop.set)

        running.supervise(failed)
        await stop.wait()

    try:
        asyncio.run(wait())
    finally:
        running.stop()
        print("pipespec: stopped", flush=True)
    for why in failures:
        print(f"pipespec: the pipeline cannot be restored: {why}", file=sys.stderr, flush=True)
    return 1 if failures else 0


def _http(port: int | None, host: str | None, allowed_media: str | None) -> HttpSpec | None:
    """The HTTP server the flags ask for (None: no --http-port); ConfigError for a flag without it or a
    media directory that is not one."""
    if port is None:
        if host is not None or allowed_media is not None:
            raise ConfigError("--http-host and --allowed-local-media-path are for the HTTP server: give --http-port too")
        return None
    media = None
    if allowed_media is not None:
        media = Path(allowed_media).resolve()  # the coordinator's actor may run in another directory
        if not media.is_dir():
            raise ConfigError(f"--allowed-local-media-path {allowed_media!r} is not a directory")
    return HttpSpec(port, host, media)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a pipeline YAML file, or the name of an example shipped in pipespec/configs (e.g. mock3)")
    parser.add_argument("--address", help="Ray cluster address (default: the job's cluster, else a local Ray)")
    parser.add_argument("--host", help="interface the gRPC servers bind (default: the config's server.host)")
    parser.add_argument("--port", type=int, help="coordinator port (default: the config's server.port; 0 = any)")
    parser.add_argument("--strategy", default="pack", choices=list(STRATEGIES), help="how devices are placed on nodes")
    parser.add_argument("--http-port", type=int, help="also serve OpenAI-compatible HTTP on this port (0 = any; default: none)")
    parser.add_argument("--http-host", help="interface the HTTP server binds (default: the coordinator's host)")
    parser.add_argument("--allowed-local-media-path", help="a directory whose files image_url may name (default: none)")
    add_log_level(parser, default="INFO")
    args = parser.parse_args(argv)
    try:
        setup_logging(args.log_level)
    except LoggingConfigError as e:
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
    http = (args.http_port, args.http_host, args.allowed_local_media_path)
    return serve(args.config, args.address, args.host, args.port, args.strategy, *http)


if __name__ == "__main__":
    sys.exit(main())
