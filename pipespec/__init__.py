"""pipespec: asynchronous hierarchical speculative decoding, exactly equal to the target alone.

The names users touch: `load_config` and `LocalPipeline` (one process), `Client` (remote).
"""

from pipespec.config import ConfigError, PipelineConfig, load_config
from pipespec.local import LocalPipeline
from pipespec.outputs import Delta, Generation, GenerationError

__all__ = ["ConfigError", "Delta", "Generation", "GenerationError", "LocalPipeline", "PipelineConfig", "load_config"]
