"""Checks of the command line's error reporting, shared by the CLI tests."""

from trl_longrm.cli import main


def run_cli(capsys, command: str, *argv) -> tuple[int, str]:
    """`trl-longrm COMMAND ARGV` through the command line's `main` (an exception escaping it is a traceback): the exit
    code and what went to stderr."""
    code = main([command, *argv])
    return code, capsys.readouterr().err


def assert_one_error(code: int, stderr: str, *expected: str):
    """A user's mistake: exit code 1, one error line containing each `expected` text, no traceback."""
    assert code == 1 and "Traceback" not in stderr
    assert stderr.count("trl-longrm: error:") == 1, stderr
    for text in expected:
        assert text in stderr, stderr
