"""The one error type users see.

Every user-facing failure raises :class:`NpuqError` (or a subclass) with a message that names
the input, what was wrong and the fix. The CLI prints it on one line and exits with status 2;
any other exception is a bug in npuq and keeps its traceback.
"""


class NpuqError(Exception):
    """A problem with the user's input or environment, explained in the message."""


class ModelLoadError(NpuqError):
    """A model source that cannot be read (missing, corrupt, unsupported)."""


class UnsupportedArchitecture(ModelLoadError):
    """A model whose architecture the static decoder does not implement."""
