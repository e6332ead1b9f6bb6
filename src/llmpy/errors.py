"""The one exception type a user can cause. The command line prints its message as one line and
exits non-zero; everything else is a bug and keeps its traceback."""


class LlmpyError(Exception):
    """Bad input from the user: a file, a flag, a size. The message names what and where."""
