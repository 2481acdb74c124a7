"""The runtime's errors that are not about one generation: an invalid config, a peer breaking the protocol.

`ConfigError` has its own module, the lowest of the runtime, so that everything that raises it imports
it from here: `pipespec.config`, the table of stage kinds it validates with (`pipespec.schema.kinds`),
the stages themselves. `pipespec.config` re-exports it, and that is where users import it from.
"""


class ConfigError(ValueError):
    """A pipeline config (or a value given at its boundary) is invalid; the message names it."""


class ProtocolError(ValueError):
    """A peer's message breaks the pipeline protocol (design section 2): a stage runner raises it, and it
    fails the request the message is about (pipespec.engine.runner). The message names the kind, the request,
    the stage, the field and the values."""
