"""User-facing errors: one clear line, caught at the CLI boundary, non-zero exit."""


class EngineError(Exception):
    """An error the user can act on. `str(e)` is a single line: control characters
    that reach a message (a tensor name or path from a hostile file) are escaped."""

    def __str__(self) -> str:
        text = super().__str__()
        if text.isprintable():
            return text
        return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class ModelFileError(EngineError):
    """The model file is missing, not a GGUF, truncated or malformed."""


class UnsupportedError(EngineError):
    """The model uses an architecture or tensor type we do not implement."""


class ConfigError(EngineError):
    """A malformed environment variable, CLI flag or API argument."""


class BackendUnavailable(EngineError):
    """The requested backend cannot run on this machine (names what is missing)."""
