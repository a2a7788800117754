"""The project's own error types: every bad input ends in one of these, never a stray exception."""


class FlexPipeError(Exception):
    """Base class for errors FlexPipe reports to a person as one clear line."""


class ValidationError(FlexPipeError):
    """An event, scenario or command failed validation.

    `field` is the dotted path of the offending entry (``payload.memory_free_bytes``,
    ``timeline[3].gpus``) and `reason` says what is wrong with it.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


class ConfigError(FlexPipeError):
    """The process configuration is invalid; the message names the key."""
