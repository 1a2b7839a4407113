"""`splitserve make-model --out` that cannot be written: one line naming --out, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_workers.cli import main


def test_out_that_is_a_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a-file"
    out.write_text("keep me")
    assert main(["make-model", "--preset", "tiny-llama", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve make-model: --out: ") and "Traceback" not in err, err
    assert out.read_text() == "keep me"


def test_out_under_a_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "model"
    assert main(["make-model", "--preset", "tiny-llama", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("splitserve make-model: --out: cannot write ") and "Traceback" not in err
