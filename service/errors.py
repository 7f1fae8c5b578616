"""The exception tree. `service.api` maps each class to an HTTP status and a gRPC code in one place."""


class MoEError(Exception):
    """Base of every error the service raises on purpose."""


class ConfigError(MoEError, ValueError):
    """An impossible configuration value; the message names the field."""


class BackendUnavailable(ConfigError):
    """The backend asked for cannot run here (`--backend fused` without CUDA or peer access); the
    message says why. The ranks decide (service.worker.rank) and the start fails with it."""


class WeightsError(MoEError):
    """A checkpoint that cannot be loaded: missing key, wrong shape, unreadable file."""


class InvalidInput(MoEError, ValueError):
    """A request whose tensors are malformed (shape, dtype, range, non-finite values)."""


class WorkerError(MoEError):
    """The rank group failed: a rank raised, died, or timed out. Carries the rank's traceback,
    which str() appends (for the log) and the message (args[0], what a client sees) leaves out.

    Built from another WorkerError's str() (service.fleet sends it as text to the other front
    ends), it splits the text back into the message, the rank and the traceback, so that the
    traceback reaches no client of those front ends either."""

    def __init__(self, message: str, rank: int | None = None, traceback: str | None = None):
        head, marker, tail = message.partition(_TRACEBACK_MARK)
        rank_text, newline, relayed = tail.partition(_TRACEBACK_END)
        if traceback is None and marker and newline and rank_text.isdigit():
            message, rank, traceback = head, int(rank_text), relayed
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.traceback:
            text += f"{_TRACEBACK_MARK}{self.rank}{_TRACEBACK_END}{self.traceback}"
        return text


# str(WorkerError) with a traceback: the message, _TRACEBACK_MARK, the rank, _TRACEBACK_END, the traceback
_TRACEBACK_MARK, _TRACEBACK_END = "\n--- rank ", " traceback ---\n"


class GroupUnavailable(MoEError):
    """The rank group is not ready (starting, restarting or stopping)."""


class Overloaded(MoEError):
    """The queue is full; the request was not accepted."""


class DeadlineExceeded(MoEError):
    """The request's deadline passed before its answer was ready."""
