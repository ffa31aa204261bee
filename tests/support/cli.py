"""Running the ``qwen36`` command in-process from a test and checking its one-line user errors."""
from __future__ import annotations


def run_cli_streams(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``qwen36 ARGV`` run in-process (``capsys``: pytest's capture fixture;
    argparse usage errors exit through SystemExit)."""
    from qwen36.cli import main  # the one test-support module that may: it runs the command line as a user does

    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """Exit status and stderr of ``qwen36 ARGV`` run in-process."""
    rc, _, err = run_cli_streams(capsys, *argv)
    return rc, err


def assert_one_line_error(rc: int, err: str, *fragments: str) -> None:
    """A user mistake: exit 2, no traceback, exactly one ``error:`` line, naming every fragment."""
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [l for l in err.splitlines() if "error:" in l]
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
