"""The one exception type a user can cause, and how a value shows in its message. The command line prints its
message as one line and exits non-zero, as it does for what the system refuses (out of memory, an OSError, a failed
torch.distributed call); everything else is a bug and keeps its traceback."""


class LlmpyError(Exception):
    """Bad input from the user: a file, a flag, a size. The message names what and where."""


def shown(value, most: int = 60) -> str:
    """A value of any type as an error line shows it: its repr, cut to `most` characters and kept on one line (a
    torch module's repr has a line for each layer)."""
    return " ".join(line.strip() for line in repr(value).splitlines())[:most]
