"""The one error type users see: a single line that names the file/row and the fix."""


class EagletError(Exception):
    """A problem with the user's input or environment, reported as one line without a traceback.

    The CLI prints ``error: <message>`` and exits with ``exit_code``.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message


SIGNAL_EXIT_BASE = 128  # a shell reports a process a signal stopped as 128 + the signal's number (Ctrl-C: 130)


class Interrupted(EagletError):
    """A stage a signal stopped after it kept its work (Ctrl-C, a scheduler's SIGTERM): the same command resumes."""

    exit_code = SIGNAL_EXIT_BASE + 2  # SIGINT's

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


MAX_SHOWN = 80  # characters of a refused value that an error line repeats


def shown(value: object) -> str:
    """``repr(value)`` cut to ``MAX_SHOWN`` characters: an error line repeats what was given, not all of it."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def first_line(exc: BaseException) -> str:
    """A third-party exception's first line (its type's name when it says nothing): what an error line quotes."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
