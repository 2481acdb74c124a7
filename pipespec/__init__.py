"""pipespec: asynchronous hierarchical speculative decoding, exactly equal to the target alone.

The names users touch: `load_config` and `LocalPipeline` (one process), `Client` (remote).
`LocalPipeline` is imported lazily so that torch-free parts (the coordinator, clients) stay torch-free.

The public face, at the top: `config` (a pipeline config, validated once), `errors`, `client`
(`Client`), `local` (`LocalPipeline`) and `cli` (the `pipespec` command). Everything else sits in a
room named for its role, lowest first (tests/test_layering.py holds the order):

- `commands`: what every command line shares (logging, the shipped example configs)
- `protocol`: the messages between stages, their codec and links (torch-free)
- `engine`: what runs inside a stage's process (runner, scheduler, choice functions, ...)
- `requests`: a request's way in and out (arguments, chat, images, front door, outputs)
- `stages`: the stage kinds and their table (`schema.kinds`), and building them
- `serving`: the coordinator and how it is served to clients (gRPC's `Serving`, the HTTP server)
- `protos`, `transport`: gRPC, its generated code and everything that imports it
- `wiring`: a config's parts built and connected, the same for every way it runs
- `planning`: `pipespec plan`, placements, profiling, the analytical model
- `cluster`: Ray, the only package that imports it
"""

from typing import TYPE_CHECKING, Any

from pipespec.client import Client
from pipespec.config import PipelineConfig, load_config
from pipespec.errors import ConfigError
from pipespec.requests.outputs import Delta, Generation, GenerationError, RequestRefused

if TYPE_CHECKING:
    from pipespec.local import LocalPipeline

__all__ = [
    "Client",
    "ConfigError",
    "Delta",
    "Generation",
    "GenerationError",
    "LocalPipeline",
    "PipelineConfig",
    "RequestRefused",
    "load_config",
]


def __getattr__(name: str) -> Any:
    if name == "LocalPipeline":
        from pipespec.local import LocalPipeline

        return LocalPipeline
    raise AttributeError(f"module 'pipespec' has no attribute {name!r}")
