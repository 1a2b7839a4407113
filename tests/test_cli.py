"""The `splitserve` command: every subcommand is registered, imports, and shows its own flags."""

from __future__ import annotations

import pytest
from splitserve_workers.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_subcommand_help_lists_its_own_flags(command: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: splitserve {command}")
    # Each module adds options beyond -h; a bare parser would list only --help.
    assert out.count("--") > 1


def test_unknown_command_is_an_error(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        main(["no-such-command"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]):
    assert main([]) == 2
    assert "make-model" in capsys.readouterr().out
