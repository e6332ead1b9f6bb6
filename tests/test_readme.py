"""The README stays true to the command line. Its `llmpy train` flag table and the train parser name the
same options: a flag the table shows must exist, and every option of the parser must be in the table (README.md
says `--help` lists them all, so the table is where a reader looks first). Its example command lines parse."""
import re
import shlex
from pathlib import Path

from llmpy.cli import build_parser
from llmpy.trainer import EXTRA_FLAGS, FLAGS

README = Path(__file__).resolve().parents[1] / "README.md"


def _train_options() -> set[str]:
    """Every option `llmpy train` takes: the trainer's flag tables, which its parser is built from."""
    return {flag for short, long, *_ in FLAGS for flag in (short, long)} | {long for long, *_ in EXTRA_FLAGS}


def _readme_train_flags(text: str) -> set[str]:
    section = text[text.index("### `llmpy train`"):text.index("Every mistake a user can make")]
    flags = set()
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith(("| flag", "| ---")):
            for code in re.findall(r"`([^`]*)`", line):
                flags.update(word for word in code.split() if re.fullmatch(r"--?[a-z][a-z0-9-]*", word))
    return flags


def test_readme_train_flags_exist_in_the_parser():
    unknown = _readme_train_flags(README.read_text()) - _train_options()
    assert not unknown, f"README.md shows train flags the parser does not have: {sorted(unknown)}"


def test_every_train_option_is_in_the_readme():
    missing = _train_options() - _readme_train_flags(README.read_text())
    assert not missing, f"train options missing from README.md's flag table: {sorted(missing)}"


def test_the_check_sees_a_wrong_flag():
    # the table parser must find flags at all: a README naming an unknown one is caught
    fake = ("### `llmpy train`\n| flag | long | meaning |\n| --- | --- | --- |\n"
            "| `-b` | `--batch-sise` | B |\nEvery mistake a user can make\n")
    assert _readme_train_flags(fake) == {"-b", "--batch-sise"}
    assert "--batch-sise" not in _train_options()


def _example_commands(text: str) -> list[list[str]]:
    """The README's `llmpy ...` command lines (code blocks and the two commands at the top), as argv."""
    commands = []
    for line in text.splitlines():
        for part in line.split("&&"):
            part = part.split(" # ")[0].strip()
            if part.startswith("llmpy "):
                commands.append(shlex.split(part)[1:])
    return commands


def test_readme_example_commands_parse():
    commands = _example_commands(README.read_text())
    assert len(commands) >= 7 and ["train"] in commands  # the first command, then prepare/sample/plot/export
    for argv in commands:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"README.md example `llmpy {' '.join(argv)}` does not parse") from None
        assert args.command == argv[0]
