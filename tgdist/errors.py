"""Errors that the command line reports as one line and a non-zero exit, and the one-line form of
the library's logged warnings for commands without a log of their own."""

import errno
import logging
import sys


class TgdistError(Exception):
    """Base class for user-facing errors: the message is printed alone, without a traceback."""


class DataError(TgdistError, ValueError):
    """Bad or unreadable input data; the message names the file and, where known, the line."""


class ConfigError(TgdistError, ValueError):
    """An invalid combination of settings, detected before any work starts."""


class RunFailure(TgdistError):
    """A process of a running job failed (a memory daemon or trainer died, a peer went away):
    one line, as every tgdist error, but exit code 1, since the input was not at fault (2)."""

    exit_code = 1


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when it has none), for one-line reports."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def write_failure(exc: BaseException) -> str | None:
    """One line for an OSError that stops a command writing its output (a full disk, a quota, a
    read-only or unwritable folder); None for any other error, which keeps its traceback."""
    if not isinstance(exc, OSError) or exc.errno not in _WRITE_ERRNOS:
        return None
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}cannot write ({exc.strerror or exc})"


_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG}


class _CommandLines(logging.Formatter):
    def __init__(self, command: str):
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        return f"{self.command}: {record.levelname.lower()}: {record.getMessage()}"


def log_warnings_as_lines(command: str) -> None:
    """Show warnings the library logs (``tgdist.*``: an unwritable cache, say) on stderr as
    ``COMMAND: warning: ...``, for commands that configure no logging (``tgdist data``,
    ``tgdist partition``); without this, Python prints them bare."""
    logger = logging.getLogger("tgdist")
    if logging.getLogger().handlers or any(isinstance(h.formatter, _CommandLines) for h in logger.handlers):
        return  # logging is set up (a test's capture, an embedding program): leave it alone
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CommandLines(command))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
