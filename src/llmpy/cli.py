"""`llmpy` command line: train, prepare, sample, plot, export. A user's mistake (LlmpyError) is one line on stderr
and exit status 1; an interrupt exits with 130, SIGTERM with 143, after the subcommand has cleaned up."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import warnings

from .errors import LlmpyError


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


# name, module, help; every subcommand module has add_arguments(parser) and run(args)
COMMANDS = (
    ("train", "trainer", "train a model (no arguments: the embedded default)"),
    ("prepare", "prepare", "tokenize text into llm.c token shards"),
    ("sample", "sampler", "generate text from a model file"),
    ("plot", "plot", "draw PNG charts of a run from its main.jsonl"),
    ("export", "export", "export a model to a HuggingFace transformers folder"))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `llmpy` parser. With `command`, only that subcommand's module is imported and its flags added (the
    others are listed for --help): `llmpy plot` then never loads torch, half a GB and a second."""
    import importlib
    parser = OneLineParser(prog="llmpy", description="GPT-2-family training from Python, llm.c's design.",
                           allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, module_name, help_ in COMMANDS:
        # train's -h is llm.c's HellaSwag flag, so its help is --help only
        cmd = sub.add_parser(name, help=help_, add_help=name != "train", allow_abbrev=False)
        if command is None or command == name:
            module = importlib.import_module(f".{module_name}", __package__)
            module.add_arguments(cmd)
            cmd.set_defaults(func=module.run)
    return parser


def _torch_oom():
    """torch's out-of-memory exception (a RuntimeError, not a MemoryError), or MemoryError where torch was never
    loaded (nothing could have raised its exception)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "OutOfMemoryError", MemoryError) if torch is not None else MemoryError


_CPU_ALLOCATOR_FAILED = "can't allocate memory"


# what would break an error line: the C0 controls but tab, DEL, and the line breaks str.splitlines knows beyond
# them, written as Python escapes (a file named "a\nb.bin" made two lines of one error)
_LINE_BREAKERS = {code: ascii(chr(code))[1:-1] for code in (*range(0x20), 0x7F, 0x85, 0x2028, 0x2029) if code != 0x09}


def _one_line(message: str) -> str:
    return message.translate(_LINE_BREAKERS)


def _out_of_memory(who: str, e: BaseException) -> int:
    lines = [line for line in str(e).splitlines() if line.strip()]
    detail = lines[0] if lines else "host memory exhausted"
    # torch's CPU allocator opens with "[enforce fail at alloc_cpu.cpp:N] err == 0." before what it could not allocate
    detail = detail[detail.find("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in detail else detail
    print(f"{who}: error: out of memory ({detail[:200]}); lower the batch size -b, "
          "raise recompute -r, or use a smaller model", file=sys.stderr)
    return 1


def _dist_error():
    """torch.distributed's error base class (a peer that died, a timeout), or a class nothing raises."""
    if "torch" not in sys.modules:
        return LlmpyError  # already caught before this clause
    import torch.distributed as dist
    return getattr(dist, "DistError", LlmpyError) if dist.is_available() else LlmpyError


def _from_a_collective(e: RuntimeError) -> bool:
    """gloo reports a peer that closed its connection as a plain RuntimeError ("[../gloo/transport/tcp/pair.cc:
    ...] Connection closed by peer"), not as torch.distributed's DistError."""
    return "torch.distributed" in sys.modules and any(word in str(e) for word in ("gloo", "Gloo", "NCCL", "c10d"))


def _warnings_as_notes(command: str) -> None:
    """llmpy's own warnings (a model file's unusual setting, ...) print as one note line, not as Python's two lines
    of file, line number and source; other libraries' keep Python's format."""
    here = os.path.dirname(os.path.abspath(__file__))
    python_format = warnings.formatwarning

    def format_warning(message, category, filename, lineno, line=None):
        if os.path.abspath(filename).startswith(here + os.sep):
            return f"llmpy {command}: note: {_one_line(str(message))}\n"
        return python_format(message, category, filename, lineno, line)
    warnings.formatwarning = format_warning


class Terminated(BaseException):
    """SIGTERM, raised where the command is, so that its cleanup runs as for Ctrl-C (train's loop takes SIGTERM
    itself: it saves a checkpoint and stops)."""


def _raise_terminated(signum, frame):
    raise Terminated


def _speaker(command: str) -> str:
    """How this process's error lines begin: `llmpy train`, and under torchrun with several processes `llmpy train:
    rank 1 of 2`, since every rank writes to the same terminal or log and only one may have failed. From the
    environment alone (no torch import here); a malformed one is train's own error to report."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return f"llmpy {command}"
    return f"llmpy {command}: rank {rank} of {world}" if world > 1 else f"llmpy {command}"


def _escape_what_stdout_cannot_encode():
    """Characters stdout's encoding lacks (an ASCII or Latin-1 console, PYTHONIOENCODING=ascii) written as \\xNN
    escapes: a sample's or a path's character ended a run in a UnicodeEncodeError traceback."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None and getattr(sys.stdout, "errors", None) == "strict":
        try:
            reconfigure(errors="backslashreplace")
        except (ValueError, OSError):  # a stream that cannot change its error handler: left as it is
            pass


def _quiet_stdout():
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (a test's StringIO)
        pass


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _escape_what_stdout_cannot_encode()
    names = [name for name, _, _ in COMMANDS]
    command = argv[0] if argv and argv[0] in names else ""
    try:  # the command's module may import torch: a second or so in which Ctrl-C may land
        parser = build_parser(command)
    except KeyboardInterrupt:  # said as every later line is, so that torchrun's ranks tell theirs apart
        sys.stderr.write(f"{_speaker(command) if command else 'llmpy'}: interrupted\n")
        return 130
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _warnings_as_notes(args.command)
    who = _speaker(args.command)
    in_main_thread = threading.current_thread() is threading.main_thread()
    old_sigterm = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        try:
            return args.func(args) or 0
        finally:  # the command is over: a SIGTERM now (torchrun ending the other ranks) must not break its last line
            if in_main_thread:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except LlmpyError as e:
        # one write: under torchrun every rank says the same line, and two half-written lines would run together
        sys.stderr.write(f"{who}: error: {_one_line(str(e))}\n")
        return 1
    except (MemoryError, _torch_oom()) as e:
        return _out_of_memory(who, e)
    except BrokenPipeError:
        # the reader of stdout went away (`llmpy sample | head`): stop quietly, as a C program killed by SIGPIPE
        # would; stdout goes to /dev/null so that the interpreter's flush at exit cannot fail a second time
        _quiet_stdout()
        return 128 + 13  # SIGPIPE on Linux and macOS (Windows has no signal.SIGPIPE)
    except OSError as e:  # the system refused a read or write the checks could not foresee (disk full, ...)
        where = f"{e.filename}: " if e.filename else ""
        print(f"{who}: error: {_one_line(f'{where}{e.strerror or e}')}", file=sys.stderr)
        return 1
    except (_dist_error(), RuntimeError) as e:
        if _CPU_ALLOCATOR_FAILED in str(e):  # torch's CPU allocator says so in a plain RuntimeError
            return _out_of_memory(who, e)
        if not isinstance(e, _dist_error()) and not _from_a_collective(e):
            raise  # a bug: its traceback
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{who}: error: data-parallel communication failed ({detail[:200]}); another "
              "process may have stopped first: see its output", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{who}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{who}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, old_sigterm)


if __name__ == "__main__":
    sys.exit(main())
