"""The package's shape, held by the suite: layers that only point down, small modules, small parts.

``lint-imports`` checks the contracts in pyproject.toml (the layers, no cycles between siblings,
no torch on the networking side). The sizes are issue 24's targets and ARCHITECTURE.md's rules:
no module over 400 lines, no function over 60, no class over 20 methods, at most 10 files at the
package's top level, a docstring at the top of every module.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "p2pswarm"
MAX_MODULE_LINES = 400  # ARCHITECTURE.md: modules under 400 lines
MAX_FUNCTION_LINES = 60  # issue 24: no function over 60 lines (aim for 40)
MAX_METHODS = 20  # ARCHITECTURE.md: classes under 20 methods
MAX_TOP_LEVEL_FILES = 10  # issue 24: at most 10 files at the package's top level


def _modules() -> list[tuple[Path, str, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        out.append((path.relative_to(PACKAGE.parent), text, ast.parse(text)))
    return out


def test_import_contracts_are_kept():
    program = shutil.which("lint-imports")
    if program is None:
        pytest.fail("lint-imports is missing: pip install -e '.[dev]' installs import-linter")
    result = subprocess.run([program, "--no-cache"], capture_output=True, text=True, cwd=PACKAGE.parent,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-4000:]


def test_no_module_over_the_limit():
    big = {str(p): len(t.splitlines()) for p, t, _ in _modules() if len(t.splitlines()) > MAX_MODULE_LINES}
    assert not big


def test_no_function_over_the_limit():
    long = []
    for path, _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    assert not long


def test_no_class_over_the_limit():
    wide = []
    for path, _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > MAX_METHODS:
                    wide.append(f"{path}:{node.lineno} {node.name} ({len(methods)} methods)")
    assert not wide


def test_top_level_is_small_and_every_module_says_what_it_is():
    assert len(list(PACKAGE.glob("*.py"))) <= MAX_TOP_LEVEL_FILES
    assert not [str(p) for p, _, tree in _modules() if not ast.get_docstring(tree)]


def test_networking_import_does_not_load_torch():
    code = ("import sys, p2pswarm.node.config, p2pswarm.dht.discovery, p2pswarm.nat.autonat, p2pswarm.net.pool; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE.parent)
    assert result.stdout.strip() == "False", result.stderr[-2000:]
