"""The README and docs/ show only `ssd` commands the real parser accepts, stay short, and carry no history.

Every `ssd ...` command in a bash block (also `.venv/bin/ssd ...`, and one after `--`, as in `ray job submit ... --
ssd batch ...`) is parsed with :func:`ssd_cli.main.build_parser`, after joining line continuations and dropping
comments, a trailing `&` and shell redirections. Placeholder values are fine where argparse accepts them; an
unknown flag is not.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ssd_cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 400
MAX_LINE_CHARS = 120
HISTORY = re.compile(r"session\s+\d", re.IGNORECASE)
# where a command starts: the start of a line, or after `--` (a command run by another, e.g. `ray job submit`)
SSD_COMMAND = re.compile(r"(?:^|\s--\s+)((?:\S*/)?ssd\s.*)$")
# shell operators that end the command's own arguments: background, pipes, lists, redirections
SHELL_STOP = re.compile(r"^(?:&|&&|\||\|\||;|\d*>>?(?:&\d*)?|<)$|^\d*>|^<")


def _bash_blocks(text: str) -> list[tuple[str, str]]:
    """(heading path, block) for every ```bash block; the heading path is the `## ` heading above it."""
    blocks, section, inside, lines = [], "", False, []
    for line in text.splitlines():
        if not inside and line.startswith("## "):
            section = line[3:].strip()
        if not inside and line.strip() in ("```bash", "```sh", "```shell"):
            inside, lines = True, []
        elif inside and line.strip() == "```":
            inside = False
            blocks.append((section, "\n".join(lines)))
        elif inside:
            lines.append(line)
    return blocks


def _commands(block: str) -> list[str]:
    """The `ssd` command lines of a bash block, with line continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    found = []
    for line in joined.splitlines():
        m = SSD_COMMAND.search(line.strip())
        if m:
            found.append(m.group(1))
    return found


def _argv(command: str) -> list[str]:
    """The arguments after `ssd`: comments, a trailing `&` and redirections dropped."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars="&|;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    tokens = list(lexer)
    assert tokens and tokens[0].split("/")[-1] == "ssd", command
    args = []
    for tok in tokens[1:]:
        if SHELL_STOP.match(tok):
            break
        args.append(tok)
    return args


def _parse(args: list[str]) -> None:
    build_parser().parse_args(args)


def _documented(path: Path, sections: tuple[str, ...] | None = None) -> list[str]:
    return [cmd for section, block in _bash_blocks(path.read_text(encoding="utf-8"))
            if sections is None or section in sections for cmd in _commands(block)]


def test_quick_start_and_using_it_commands_parse() -> None:
    commands = _documented(README, ("Quick start", "Using it"))
    subcommands = {_argv(c)[0] for c in commands}
    assert {"generate", "serve", "client", "batch"} <= subcommands, subcommands
    for command in commands:
        try:
            _parse(_argv(command))
        except SystemExit:
            pytest.fail(f"README command does not parse: {command}")


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_every_documented_ssd_command_parses(path: Path) -> None:
    for command in _documented(path):
        try:
            _parse(_argv(command))
        except SystemExit:
            pytest.fail(f"{path.name}: command does not parse: {command}")


def test_the_extraction_and_the_parser_reject_a_made_up_flag() -> None:
    block = ("ssd generate --chat 'Hi' --mode ssd   # a comment --no-such-flag\n"
             ".venv/bin/ssd serve --http-port 8000 &\n"
             "ray job submit --address http://HEAD:8265 -- \\\n  ssd batch --input a.jsonl --output b.jsonl > log 2>&1\n"
             "curl -N localhost:8000/v1/models\n")
    commands = _commands(block)
    assert [_argv(c) for c in commands] == [
        ["generate", "--chat", "Hi", "--mode", "ssd"],
        ["serve", "--http-port", "8000"],
        ["batch", "--input", "a.jsonl", "--output", "b.jsonl"],
    ]
    for args in map(_argv, commands):
        _parse(args)
    with pytest.raises(SystemExit):
        _parse(_argv("ssd generate --chat Hi --made-up-flag 3"))
    with pytest.raises(SystemExit):
        _parse(_argv("ssd serve --made-up-flag"))


def test_readme_is_short_and_wrapped() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    long = [i for i, line in enumerate(lines, 1) if len(line) > MAX_LINE_CHARS]
    assert not long, f"README.md lines over {MAX_LINE_CHARS} characters: {long}"


def test_no_history_in_the_readme_or_docs() -> None:
    for path in (README, *DOCS):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not HISTORY.search(line), f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
