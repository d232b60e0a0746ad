"""Errors that the command line reports as one line and a non-zero exit."""


class TgdistError(Exception):
    """Base class for user-facing errors: the message is printed alone, without a traceback."""


class DataError(TgdistError, ValueError):
    """Bad or unreadable input data; the message names the file and, where known, the line."""


class ConfigError(TgdistError, ValueError):
    """An invalid combination of settings, detected before any work starts."""
