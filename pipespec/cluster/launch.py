"""Serve a pipeline on a Ray cluster: the `ray job submit` entrypoint, and `pipespec serve`.

    ray job submit --working-dir . -- python -m pipespec.cluster.launch CONFIG [--host H] [--port P] [--strategy pack|spread]
                                                                       [--log-level LEVEL]
    pipespec serve CONFIG [--address RAY_ADDRESS]        # a local Ray unless --address

Prints the address clients connect to (`pipespec generate --address ...`, `Client(address)`), then
serves until stopped (Ctrl-C, SIGTERM, `ray job stop`), removing its actors and placement group.
The host and port default to the config's `server` section (loopback unless it says otherwise). A
config, strategy, port or placement the pipeline cannot start with is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from pipespec.cluster.bundles import STRATEGIES
from pipespec.cluster.pipeline import ray_env, start_pipeline
from pipespec.config import ConfigError, load_config
from pipespec.examples import config_path
from pipespec.logs import LoggingConfigError, add_log_level, setup_logging


def serve(config_arg: str | Mapping[str, Any], ray_address: str | None, host: str | None, port: int | None, strategy: str) -> int:
    """Serve `config_arg` (a config file, a shipped example's name, or a parsed config) until stopped.
    `host`, `port`: where clients connect (None: the config's server.host, server.port)."""
    ray_env()
    import ray

    try:
        config = load_config(config_path(config_arg) if isinstance(config_arg, str) else config_arg)
    except ConfigError as e:
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
    if ray_address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(address="local", include_dashboard=False)  # a Ray of our own on this machine
    else:
        ray.init(address=ray_address)  # the cluster we were submitted to (RAY_ADDRESS) or asked for
    try:
        running = start_pipeline(config, host=host, port=port, strategy=strategy)
    except ConfigError as e:  # nothing left running: start_pipeline cleans up after itself
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a pipeline YAML file, or the name of an example shipped in pipespec/configs (e.g. mock3)")
    parser.add_argument("--address", help="Ray cluster address (default: the job's cluster, else a local Ray)")
    parser.add_argument("--host", help="interface the gRPC servers bind (default: the config's server.host)")
    parser.add_argument("--port", type=int, help="coordinator port (default: the config's server.port; 0 = any)")
    parser.add_argument("--strategy", default="pack", choices=list(STRATEGIES), help="how devices are placed on nodes")
    add_log_level(parser, default="INFO")
    args = parser.parse_args(argv)
    try:
        setup_logging(args.log_level)
    except LoggingConfigError as e:
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
    return serve(args.config, args.address, args.host, args.port, args.strategy)


if __name__ == "__main__":
    sys.exit(main())
