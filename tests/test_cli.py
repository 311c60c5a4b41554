"""The command line: help on every subcommand, version, and one-line errors for bad input."""

import subprocess
import sys

import pytest

from regen.cli import main


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert "regen 0." in capsys.readouterr().out


@pytest.mark.parametrize("command", ["profile", "solve", "show", "demo"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: regen {command}" in out and len(out.splitlines()) > 4


def test_console_script_reports_errors_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: regen-profile/42\n")
    proc = subprocess.run([sys.executable, "-m", "regen.cli", "show", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_reference_in_docs_is_current():
    from pathlib import Path

    from regen.cli import reference_markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
    assert doc.read_text() == reference_markdown(), (
        "docs/cli.md is stale: regenerate it with "
        "python -c \"from regen.cli import reference_markdown as r; print(r(), end='')\" > docs/cli.md")
