"""Writing files safely, without torch: atomic replacement (a temp file beside the target, fsync, rename), the
probe of an output folder before a run's work, the removal of temporaries that killed writers left behind, and
the one-line refusal of a folder or pipe where a file is read.
checkpoint.py, the data and token-shard writers, prepare, export and plot all write through these."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import time
from pathlib import Path
from typing import Callable

from .errors import LlmpyError

# a writer's temporary beside its file: hidden, named by the writing process, matched by _TEMPORARY_NAME
_TEMPORARY_NAME = re.compile(r"^\.(.+)\.(\d+)\.[0-9a-f]{8}\.(?:tmp|part|old)$")


def refuse_non_file(path: Path, what: str) -> None:
    """One line for a directory, a pipe or a dead link where `what` belongs: reading a directory fails with a
    misleading error and reading a pipe blocks. A path that is not there at all is the caller's to report."""
    path = Path(path)
    if path.is_dir():
        raise LlmpyError(f"{path} is a directory, not {what}")
    if not path.is_file() and os.path.lexists(path):
        raise LlmpyError(f"{path}: " + ("a link to nothing (or a loop of links)" if not path.exists() else
                                        f"not a regular file, so not {what}"))


def expand_user(path) -> Path:
    """Path(path) with a leading ~ or ~user expanded; a user with no known home folder is one line naming the path
    (Path.expanduser raises a bare RuntimeError)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise LlmpyError(f"{path}: no home folder is known for the user it names") from None


def temporary_sibling(path: Path, suffix: str) -> Path:
    """`.NAME.PID.TAG.SUFFIX` beside `path` (suffix "tmp": atomic_path's; "part": prepare's staged shards; "old":
    the shards they replace, set aside while they move in), so that remove_orphaned_temporaries can tell a killed
    writer's leftovers by the process id."""
    tail = f".{os.getpid()}.{secrets.token_hex(4)}.{suffix}"
    # the name cut to keep the whole within NAME_MAX (255 bytes): a valid long name would fail as the temporary's
    name = os.fsdecode(os.fsencode(path.name)[:max(1, 254 - len(tail))])
    return path.with_name(f".{name}{tail}")


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temp path next to `path`; on success fsync it and rename it over `path`.

    On any exception the temp file is removed and an existing file at `path` is left untouched.
    For writers that want a file name (safetensors); `atomic_write` is the file-object form.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise LlmpyError(f"cannot write {path}: directory {directory} does not exist")
    # Not mkstemp: its 0600 mode would stick to the final file; 0666 lets the umask decide.
    tmp = temporary_sibling(path, "tmp")
    try:  # from the file's creation on: a signal in the next lines must not leave it behind
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = os.stat(tmp).st_mode & 0o777
        yield Path(tmp)
        os.chmod(tmp, mode)  # a writer that recreates the file (safetensors does, as 0600) keeps the umask's mode
        with open(tmp, "rb+") as f:  # the writer may have closed it without syncing
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def atomic_write(path, writer: Callable) -> None:
    """Call writer(f) on a binary file that replaces `path` only once writer returned."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            writer(f)
            f.flush()


def writable_dir(folder, what: str, name: str | None = None) -> Path:
    """Create `folder` if missing and write a probe file in it, so that a run fails before its work, not
    at its first save; an LlmpyError naming the folder (or `name`, e.g. the flag) and the reason."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".llmpy-probe.{os.getpid()}.{secrets.token_hex(4)}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        if isinstance(e, FileExistsError) and not folder.is_dir():  # a file (or a link to one) where it goes
            if folder.is_symlink() and not folder.exists():  # mkdir does not follow a link to nothing
                raise LlmpyError(f"{name or folder}: a link to {os.readlink(folder)}, which does not exist; the "
                                 f"{what} must be a folder (create the link's target)") from None
            raise LlmpyError(f"{name or folder}: a file is there; the {what} must be a folder") from None
        raise LlmpyError(f"{name or folder}: cannot create or write the {what} ({e.strerror or e})") from None
    return folder


# flock's errors on a file system that takes no locks (Lustre without -o flock, some NFS and FUSE mounts; EBADF: NFS
# emulates flock with byte-range locks, which want a file opened for writing): the run or prepare goes on with a note
NO_LOCKS_ERRNOS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)

ORPHAN_MIN_AGE_S = 600  # untouched this long: not a write still going on (on another host of a shared folder, say)
# every writer goes through this module, so no temporary of this process is older than its import: one that is was
# left by an earlier process of the same id (a restarted container's trainer is process 1 again)
_IMPORTED_AT = time.time()


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: beyond a C int, an id no process has
        return False
    except OSError:  # EPERM: another user's process
        return True
    return True


def remove_orphaned_temporaries(folder, log: Callable[[str], None] | None = None,
                                kept_out: re.Pattern | None = None) -> int:
    """Remove the temporaries llmpy's writers leave where their process was killed mid-write (SIGKILL, the OOM
    killer, a power cut): a name of atomic_path's or prepare's pattern, a process id no process has (or this
    process's id, on a file older than this process), and no change for ORPHAN_MIN_AGE_S. `kept_out`: the files
    whose writers a lock this process holds keeps out of the folder (a run's checkpoints), whose temporaries are
    a killed writer's however new (a preempted job restarted at once would otherwise leave GBs each time).
    Returns how many it removed, and says so through `log` if it removed any."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        match = _TEMPORARY_NAME.match(entry.name)
        try:
            if not match or not entry.is_file(follow_symlinks=False):
                continue
            pid, mtime = int(match.group(2)), entry.stat(follow_symlinks=False).st_mtime
            writer_runs = _process_exists(pid) and not (pid == os.getpid() and mtime < _IMPORTED_AT)
            locked_out = kept_out is not None and kept_out.fullmatch(match.group(1)) and pid != os.getpid()
            if not locked_out and (writer_runs or time.time() - mtime < ORPHAN_MIN_AGE_S):
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed += 1
    if removed and log is not None:
        log(f"note: removed {removed} temporary file(s) in {folder} left by a killed llmpy process")
    return removed


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not all filesystems allow opening a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
