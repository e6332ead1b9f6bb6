"""The README stays true to the command line. Its `llmpy train` flag table and the train parser name the
same options: a flag the table shows must exist, and every option of the parser must be in the table (README.md
says `--help` lists them all, so the table is where a reader looks first). Its example command lines parse."""
import re
import shlex
import sys
from pathlib import Path

from llmpy.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def _train_options() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a.choices, dict) and "train" in a.choices)
    return {opt for action in sub.choices["train"]._actions for opt in action.option_strings}


def _readme_train_flags() -> set[str]:
    text = README.read_text()
    section = text[text.index("### `llmpy train`"):text.index("Every mistake a user can make")]
    flags = set()
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith(("| flag", "| ---")):
            for code in re.findall(r"`([^`]*)`", line):
                flags.update(word for word in code.split() if re.fullmatch(r"--?[a-z][a-z0-9-]*", word))
    return flags


def test_readme_train_flags_exist_in_the_parser():
    unknown = _readme_train_flags() - _train_options()
    assert not unknown, f"README.md shows train flags the parser does not have: {sorted(unknown)}"


def test_every_train_option_is_in_the_readme():
    missing = {opt for opt in _train_options() if opt != "--help"} - _readme_train_flags()
    assert not missing, f"train options missing from README.md's flag table: {sorted(missing)}"


def test_the_check_sees_a_wrong_flag(monkeypatch, tmp_path):
    # the table parser must find flags at all: a README naming an unknown one is caught
    fake = tmp_path / "README.md"
    fake.write_text("### `llmpy train`\n| flag | long | meaning |\n| --- | --- | --- |\n"
                    "| `-b` | `--batch-sise` | B |\nEvery mistake a user can make\n")
    monkeypatch.setattr(sys.modules[__name__], "README", fake)
    assert _readme_train_flags() == {"-b", "--batch-sise"}
    assert "--batch-sise" not in _train_options()


def _example_commands() -> list[list[str]]:
    """The README's `llmpy ...` command lines (code blocks and the two commands at the top), as argv."""
    commands = []
    for line in README.read_text().splitlines():
        for part in line.split("&&"):
            part = part.split(" # ")[0].strip()
            if part.startswith("llmpy "):
                commands.append(shlex.split(part)[1:])
    return commands


def test_readme_example_commands_parse():
    commands = _example_commands()
    assert len(commands) >= 7 and ["train"] in commands  # the first command, then prepare/sample/plot/export
    for argv in commands:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"README.md example `llmpy {' '.join(argv)}` does not parse") from None
        assert args.command == argv[0]
