"""Error types shared by every layer (no heavy imports).

``UserError`` and its subclasses mean the input was wrong (bad path, bad option value, bad data):
the CLI prints one line and exits 2. Anything else is an internal error (exit 1).
"""


class UserError(Exception):
    """Bad usage or bad input: reported as one line, exit code 2."""

    exit_code = 2


class Reported(UserError):
    """Bad input whose error line is on stderr already (an image command's one input, unreadable):
    exit code 2 without another line. The message still says what failed, for code that catches it."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not fit the model it claims to be."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (``timeout``, ``docker stop``, a closed terminal). A BaseException,
    like KeyboardInterrupt, so it unwinds every ``finally`` (temporary files are removed) and no
    ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Notice(UserWarning):
    """A notice for the user from below the command line (a placement choice it overrode, say): the
    command shows it as one ``warning:`` line, once."""
