"""The toolkit's own error types.

Every failure caused by user input (a file, a record, a config value) raises a subclass of
`EagleError` whose message names the file, record or field and says what to do. Entry points print
that message and exit with status 2 instead of showing a traceback.
"""


class EagleError(Exception):
    """Base class for errors caused by input the user can fix."""


class DataError(EagleError):
    """A conversation file, record or field is malformed or unusable."""


class TargetError(EagleError):
    """The target model or its tokenizer cannot be loaded or used as configured."""


class CaptureError(EagleError):
    """Captured shards or their manifest are missing, corrupt or from another run."""


class CheckpointError(EagleError):
    """A draft-head checkpoint is missing, corrupt, or does not fit the target/algorithm."""


class TrainingError(EagleError):
    """A training run learnt nothing usable (non-finite held-out metrics, every step skipped)."""


class ExportError(EagleError):
    """An exported folder is incomplete or inconsistent."""


class ServerError(TargetError):
    """An inference server of `regenerate.backend=server` is unreachable, refused a request, or answered
    something unusable. The message names the server (URL) and what it said."""
