"""The habits `make test` checks: the import layers of pyproject.toml's [tool.importlinter] (no import
cycles, utils below everything that uses it) and ruff's lint and format rules."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    path = str(exe) if exe.exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return path


def test_import_layers_are_kept():
    r = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_ruff_lint_and_format_are_clean():
    ruff = _tool("ruff")
    check = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-1000:]
    fmt = subprocess.run([ruff, "format", "--check", "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert fmt.returncode == 0, "run `ruff format .`: " + fmt.stdout[-3000:] + fmt.stderr[-1000:]
