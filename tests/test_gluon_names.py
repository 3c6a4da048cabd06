"""The Gluon names that changed between Triton releases (``fp8_block/gluon_names.py``): resolved to the
running Triton's builtins, the newer name preferred, and no kernel module calling a version-specific
name directly (a direct call breaks the build on the other Triton versions)."""

from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("triton.experimental.gluon", reason="the Gluon kernels need triton>=3.6")


def test_names_resolve_to_this_tritons_builtins():
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma

    from te_fused_moe.backends.triton.fp8_block import gluon_names as G

    for fn in (G.thread_barrier, G.tma_load, G.tma_store):
        assert getattr(fn, "__triton_builtin__", False), fn
    assert G.thread_barrier in (getattr(gl, "barrier", None), getattr(gl, "thread_barrier", None))
    assert G.tma_load in (getattr(tma, "async_load", None), getattr(tma, "async_copy_global_to_shared", None))
    assert G.tma_store in (getattr(tma, "async_store", None), getattr(tma, "async_copy_shared_to_global", None))


@pytest.mark.parametrize("newer", [False, True])
def test_resolve_prefers_the_newer_names(newer):
    from te_fused_moe.backends.triton.fp8_block.gluon_names import resolve

    old = SimpleNamespace(thread_barrier="tb", async_copy_global_to_shared="cg", async_copy_shared_to_global="cs")
    language, tma = SimpleNamespace(**vars(old)), SimpleNamespace(**vars(old))
    if newer:  # Triton 3.9: both sets exist, the old ones raising when called
        language.barrier, tma.async_load, tma.async_store = "b", "l", "s"
    assert resolve(language, tma) == (("b", "l", "s") if newer else ("tb", "cg", "cs"))


def test_kernels_call_no_version_specific_name():
    root = pathlib.Path(__file__).resolve().parents[1] / "te_fused_moe" / "backends" / "triton"
    pattern = re.compile(r"\b(gl\.thread_barrier|gl\.barrier|tma\.async_copy_global_to_shared|"
                         r"tma\.async_copy_shared_to_global|tma\.async_load|tma\.async_store)\s*\(")
    offenders = [f"{path.relative_to(root)}:{n}" for path in root.rglob("*.py") if path.name != "gluon_names.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, f"call these through fp8_block/gluon_names.py: {offenders}"
