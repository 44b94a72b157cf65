"""A command-line refusal checked in the test's own process.

The refusals of bad input happen before any process starts, so most cases need no subprocess of their own: each
would spend ~3 s of CPU importing torch again. A test keeps one real subprocess among its cases, to show that a
real ``meshtrain`` process prints the same single line, and checks the others with ``cli_refusal``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest


def cli_refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``meshtrain argv`` in this process: it must exit with code 2 and print exactly one line on stderr, starting
    ``error: `` (no traceback, no ``[rank N]`` line from a started process); returns that line."""
    from meshtrain.cli import main

    capsys.readouterr()  # only this call's output
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, code, err)
    return lines[0]
