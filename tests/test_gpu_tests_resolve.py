"""The GPU test files (tests/gpu/) only run on the device machine, where an error costs device time:
here, on the CPU, every name they take from another module must exist.

Collecting them on the CPU already fails on a missing module-level ``from X import name``. What it
misses, and this checks: ``alias.name`` where ``import X as alias`` (the GPU files reach their
interpreter twins' ``check_*`` functions that way), and ``from X import name`` inside test bodies.
A GPU test once called a check that had moved to another module (run 26: one failure, 25 tests).
"""

from __future__ import annotations

import ast
import importlib
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
GPU_FILES = sorted(f for f in os.listdir(os.path.join(TESTS, "gpu")) if f.startswith("test_") and f.endswith(".py"))


def _import(name: str):
    """The module, or None where it cannot be imported here (an optional package such as TE, or a
    module that only imports on a GPU machine): those references stay unchecked."""
    for path in (ROOT, TESTS):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any import failure means "cannot check here"
        return None


def unresolved_names(path: str) -> list:
    """``module.name`` strings that ``path`` uses but ``module`` lacks (modules importable here only)."""
    tree = ast.parse(open(path).read(), filename=path)
    aliases = {}  # alias -> module name, from "import x.y as alias"
    wanted = []  # (module name, attribute)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted += [(node.module, a.name) for a in node.names if a.name != "*"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            wanted.append((aliases[node.value.id], node.attr))
    missing = []
    for module_name, attr in sorted(set(wanted)):
        module = _import(module_name)
        if module is not None and not hasattr(module, attr) and _import(f"{module_name}.{attr}") is None:
            missing.append(f"{module_name}.{attr}")
    return missing


@pytest.mark.parametrize("name", GPU_FILES)
def test_gpu_test_file_uses_only_names_that_exist(name):
    assert unresolved_names(os.path.join(TESTS, "gpu", name)) == []


def test_the_check_catches_a_missing_name(tmp_path):
    bad = tmp_path / "test_bad_gpu.py"
    bad.write_text("import block_scaled_checks as checks\n\n"
                   "def test_x():\n    from te_fused_moe.bench_recipes import no_such_function\n"
                   "    checks.assert_bench_baseline({})\n    checks.no_such_check('cuda')\n")
    assert unresolved_names(str(bad)) == ["block_scaled_checks.no_such_check",
                                          "te_fused_moe.bench_recipes.no_such_function"]
