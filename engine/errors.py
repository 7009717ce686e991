"""User-facing errors: one clear line, caught at the CLI boundary, non-zero exit."""


class EngineError(Exception):
    """An error the user can act on. `str(e)` is a single line: control characters
    that reach a message (a tensor name or path from a hostile file) are escaped."""

    def __str__(self) -> str:
        text = super().__str__()
        if text.isprintable():
            return text
        return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def cut(text: str, n: int = 64) -> str:
    """Text from a file or an exception, cut to n characters for a one-line message."""
    return text if len(text) <= n else text[:n] + "..."


class ModelFileError(EngineError):
    """The model file is missing, not a GGUF, truncated or malformed."""


class UnsupportedError(EngineError):
    """The model uses an architecture or tensor type we do not implement."""


class ConfigError(EngineError):
    """A malformed environment variable, CLI flag or API argument."""


class BackendUnavailable(EngineError):
    """The requested backend cannot run on this machine (names what is missing)."""


class DeviceError(EngineError):
    """A GPU reported an error while running the model (backends/cuda/errors.py turns
    the CUDA library's exceptions into these). The request fails; the process goes on
    unless it is a DeviceFault."""


class DeviceOutOfMemory(DeviceError):
    """The device ran out of memory after the load-time memory check (a request's
    scratch, cuBLAS' workspace, a KV pool made on first use). Recoverable: what the
    failed call allocated is freed as it unwinds."""


class DeviceFault(DeviceError):
    """A sticky device fault (an illegal address, a failed launch, a device-side
    assert): the CUDA context is unusable until the process exits, so the process
    must end (a server stops admitting and exits)."""
