"""The tree is ruff clean (lint and format), as CI installs ruff with the dev extras."""

import pathlib
import shutil
import subprocess
import sys

import pytest
from support.helpers import REPO


def ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe is not None, "ruff is not installed: pip install -e '.[dev]'"
    return [exe]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(args):
    proc = subprocess.run(ruff() + args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_python_is_supported():
    assert sys.version_info >= (3, 10)
