"""pipespec: asynchronous hierarchical speculative decoding, exactly equal to the target alone.

The names users touch: `load_config` and `LocalPipeline` (one process), `Client` (remote).
`LocalPipeline` is imported lazily so that torch-free parts (the coordinator, clients) stay torch-free.
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
