"""The one exception type a user can cause. The command line prints its message as one line and
exits non-zero, as it does for what the system refuses (out of memory, an OSError, a failed torch.distributed
call); everything else is a bug and keeps its traceback."""


class LlmpyError(Exception):
    """Bad input from the user: a file, a flag, a size. The message names what and where."""
