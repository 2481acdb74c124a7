"""`ConfigError`, the error of an invalid pipeline config.

Its own module so that both `pipespec.config` and the registry of stage kinds it validates with
(`pipespec.stages.registry`, whose per-kind checks raise it) can import it; `pipespec.config`
re-exports it, and that is where users import it from.
"""


class ConfigError(ValueError):
    """A pipeline config (or a value given at its boundary) is invalid; the message names it."""
