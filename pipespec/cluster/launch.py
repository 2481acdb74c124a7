"""Serve a pipeline on a Ray cluster: the `ray job submit` entrypoint, and `pipespec serve`.

    ray job submit --working-dir . -- python -m pipespec.cluster.launch CONFIG [--host H] [--port P] [--strategy pack|spread]
                                      [--http-port N [--http-host H] [--allowed-local-media-path DIR]] [--drain-seconds S]
                                      [--log-level LEVEL]
    pipespec serve CONFIG [--address RAY_ADDRESS]        # a local Ray unless --address

Prints the address clients connect to (`pipespec generate --address ...`, `Client(address)`) and,
with `--http-port`, the URL of the OpenAI-compatible HTTP server beside it (without: none), then
serves until stopped (Ctrl-C, SIGTERM, `ray job stop`), removing its actors and placement group.
Stopped, it drains first (pipespec.serving.drain): new requests are refused (HTTP 503, gRPC
UNAVAILABLE, naming the drain), running ones get `--drain-seconds` to finish, and any still running
then ends with an error (an error event and `data: [DONE]` over HTTP, an UNAVAILABLE status over
gRPC), never a cut connection; a second Ctrl-C or SIGTERM ends the drain at once. (`ray job stop`
kills the job `RAY_JOB_STOP_WAIT_TIME_S` after its SIGTERM, 3 s unless the cluster sets it higher.)
The host and port default to the config's `server` section (loopback unless it says otherwise); the
HTTP server binds `--http-host`, else the coordinator's host. A config, strategy, port or placement
the pipeline cannot start with is one line on stderr and exit 2; a port in use at once, before Ray
starts (`check_early`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipespec.cluster.bundles import STRATEGIES
from pipespec.commands.logs import LoggingConfigError, add_log_level, setup_logging
from pipespec.commands.ports import check_server_ports
from pipespec.errors import ConfigError

if TYPE_CHECKING:  # ray's, imported when serving: the command line builds its parser without it
    from pipespec.cluster.actors import HttpSpec
    from pipespec.cluster.pipeline import RunningPipeline
    from pipespec.config import PipelineConfig

log = logging.getLogger(__name__)

DRAIN_S = 20.0  # how long running requests get to finish once the server is told to stop (--drain-seconds)
SETTLE_S = 15.0  # past the drain: for the coordinator to end the requests left and send their last events


@dataclass(frozen=True)
class ServeOptions:
    """How `serve` runs a pipeline: the flags of `pipespec serve` and of this module (`from_flags`)."""

    ray_address: str | None = None  # None: the job's cluster ($RAY_ADDRESS), else a local Ray of our own
    host: str | None = None  # where clients connect (None: the config's server.host)
    port: int | None = None  # (None: the config's server.port; 0: any free port)
    strategy: str = "pack"  # how devices are placed on nodes (pipespec.cluster.bundles.STRATEGIES)
    http_port: int | None = None  # also serve OpenAI-compatible HTTP here (None: no HTTP server; 0: any)
    http_host: str | None = None  # the HTTP server's interface (None: `host`)
    allowed_media: str | None = None  # the directory whose files `image_url` may name (None: none)
    drain_s: float = DRAIN_S  # how long running requests get to finish once stopped (pipespec.serving.drain)

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> ServeOptions:
        """The options parsed from `--address` and the flags `add_serve_arguments` adds."""
        return cls(
            ray_address=args.address,
            host=args.host,
            port=args.port,
            strategy=args.strategy,
            http_port=args.http_port,
            http_host=args.http_host,
            allowed_media=args.allowed_local_media_path,
            drain_s=args.drain_seconds,
        )


def add_serve_arguments(
    parser: argparse.ArgumentParser,
    host_help: str = "interface the servers bind (default: the config's server.host)",
    port_help: str = "coordinator port (default: the config's server.port)",
) -> None:
    """CONFIG and the flags `serve` takes (all of `ServeOptions` but `--address`, whose help each command
    words for itself), with `pipespec serve`'s help unless `host_help`, `port_help` say otherwise."""
    parser.add_argument("config", help="a pipeline YAML file, or the name of an example shipped in pipespec/configs (e.g. mock3)")
    parser.add_argument("--host", help=host_help)
    parser.add_argument("--port", type=int, help=port_help)
    parser.add_argument("--strategy", default="pack", choices=list(STRATEGIES), help="how devices are placed on nodes")
    parser.add_argument("--http-port", type=int, help="also serve OpenAI-compatible HTTP on this port (0 = any; default: none)")
    parser.add_argument("--http-host", help="interface the HTTP server binds (default: the coordinator's host)")
    parser.add_argument("--allowed-local-media-path", help="a directory whose files image_url may name (default: none)")
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=DRAIN_S,
        help="on SIGTERM or Ctrl-C: refuse new requests, give running ones this long to finish, then end each left "
        f"with an error (default: {DRAIN_S:g}; a second signal stops at once)",
    )


def serve(config_arg: str | Mapping[str, Any] | PipelineConfig, options: ServeOptions = ServeOptions()) -> int:
    """Serve `config_arg` (a config file, a shipped example's name, a parsed config or a validated one) as
    `options` say until stopped; -> the exit status (2: it could not start, 1: it could not be restored)."""
    from pipespec.commands.examples import config_path
    from pipespec.config import PipelineConfig, load_config

    try:  # before anything starts: a port in use is refused at once
        if isinstance(config_arg, PipelineConfig):
            config = config_arg
        else:
            config = load_config(config_path(config_arg) if isinstance(config_arg, str) else config_arg)
        check_early(config, options)
    except ConfigError as e:
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
    from pipespec.cluster.pipeline import ray_env, start_pipeline  # imports ray

    ray_env()
    import ray

    try:
        http = _http(options)
    except ConfigError as e:
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
    if options.ray_address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(address="local", include_dashboard=False)  # a Ray of our own on this machine
    else:
        ray.init(address=options.ray_address)  # the cluster we were submitted to (RAY_ADDRESS) or asked for
    try:
        running = start_pipeline(config, host=options.host, port=options.port, strategy=options.strategy, http=http)
    except ConfigError as e:  # nothing left running: start_pipeline cleans up after itself
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
    failures: list[str] = []

    async def wait() -> None:
        loop, stop, signals = asyncio.get_running_loop(), asyncio.Event(), []
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda sig=sig: (signals.append(sig), stop.set()))
        # only now, a stop signal drains: one sent as soon as the serving line is read must not crash the server
        if running.http_address is not None:  # before the line that says it is serving, the last one
            print(f"pipespec: OpenAI-compatible HTTP at {running.http_address}", flush=True)
        print(f"pipespec: serving {config.name!r} ({len(config.stages)} stages) at {running.address}", flush=True)

        def failed(why: str) -> None:  # on the supervisor's thread
            failures.append(why)
            loop.call_soon_threadsafe(stop.set)

        running.supervise(failed)
        await stop.wait()
        if not failures and len(signals) == 1:  # two signals (even at once): no drain
            stop.clear()  # a second signal ends the drain at once
            await _drain(running, options.drain_s, stop)

    try:
        asyncio.run(wait())
    finally:
        running.stop()
        print("pipespec: stopped", flush=True)
    for why in failures:
        print(f"pipespec: the pipeline cannot be restored: {why}", file=sys.stderr, flush=True)
    return 1 if failures else 0


async def _drain(running: RunningPipeline, grace_s: float, stop: asyncio.Event) -> None:
    """Drain the coordinator (pipespec.cluster.actors.CoordinatorActor.drain) until it is done, `stop` is set,
    or the coordinator does not answer in time."""
    import ray

    stopped = asyncio.ensure_future(stop.wait())
    try:
        accepting = asyncio.wrap_future(running.coordinator.stop_accepting.remote().future())
        done, _ = await asyncio.wait({accepting, stopped}, timeout=SETTLE_S, return_when=asyncio.FIRST_COMPLETED)
        if accepting not in done:
            accepting.cancel()
            print("pipespec: stopping now: the coordinator did not start draining", file=sys.stderr, flush=True)
            return
        print(
            f"pipespec: draining (requests running: {accepting.result()}): no new ones taken, up to {grace_s:g} s for "
            "these to finish (--drain-seconds); stop again to end them now",
            flush=True,
        )
        drained = asyncio.wrap_future(running.coordinator.drain.remote(grace_s).future())
        done, _ = await asyncio.wait({drained, stopped}, timeout=grace_s + SETTLE_S, return_when=asyncio.FIRST_COMPLETED)
        if drained in done:
            cut = drained.result()
            print(f"pipespec: drained (requests still running then, ended with an error: {cut})", flush=True)
        else:
            drained.cancel()
            print("pipespec: stopping now: the requests still running are cut", file=sys.stderr, flush=True)
    except ray.exceptions.RayError as e:  # the coordinator is gone: nothing left to drain
        log.warning("could not drain the coordinator: %s", e)
    finally:
        stopped.cancel()


def check_early(config: PipelineConfig, options: ServeOptions) -> None:
    """What can be refused before anything starts, Ray-free and quick: ConfigError naming the port if the
    coordinator's, or the HTTP server's, cannot be bound here (both serve on the launcher's node), or naming
    a negative --drain-seconds. `serve` (and `pipespec serve --plan auto`, before it profiles) checks first,
    before Ray starts or a model loads."""
    if not options.drain_s >= 0:
        raise ConfigError(f"--drain-seconds must be >= 0, got {options.drain_s:g}")
    host = config.server.host if options.host is None else options.host
    port, key = (config.server.port, "server.port") if options.port is None else (options.port, "--port")
    check_server_ports(host, port, key, options.http_host, options.http_port)


def _http(options: ServeOptions) -> HttpSpec | None:
    """The HTTP server `options` ask for (None: no --http-port); ConfigError for a flag without it or a
    media directory that is not one."""
    from pipespec.cluster.actors import HttpSpec

    if options.http_port is None:
        if options.http_host is not None or options.allowed_media is not None:
            raise ConfigError("--http-host and --allowed-local-media-path are for the HTTP server: give --http-port too")
        return None
    media = None
    if options.allowed_media is not None:
        media = Path(options.allowed_media).resolve()  # the coordinator's actor may run in another directory
        if not media.is_dir():
            raise ConfigError(f"--allowed-local-media-path {options.allowed_media!r} is not a directory")
    return HttpSpec(options.http_port, options.http_host, media)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="Ray cluster address (default: the job's cluster, else a local Ray)")
    add_serve_arguments(
        parser,
        host_help="interface the gRPC servers bind (default: the config's server.host)",
        port_help="coordinator port (default: the config's server.port; 0 = any)",
    )
    add_log_level(parser)
    args = parser.parse_args(argv)
    try:
        setup_logging(args.log_level)
    except LoggingConfigError as e:
        print(f"pipespec: {e}", file=sys.stderr)
        return 2
    return serve(args.config, ServeOptions.from_flags(args))


if __name__ == "__main__":
    sys.exit(main())
