"""Which ptxas builds the Triton backend's kernels (``te_fused_moe/backends/triton/ptxas.py``): the
``TE_FUSED_MOE_PTXAS`` policy over stand-in ptxas executables that report a chosen version, and the
process-wide switch in a fresh process. What the toolkit's ptxas changes in the SASS is checked by the
offline builds in tests/test_fp8_block_wgmma.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the ptxas choice is Triton's compiler setting (pip install triton)")

from te_fused_moe.backends.triton import ptxas  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_ptxas(directory, version: str) -> str:
    """An executable named ptxas in ``directory`` that answers --version as CUDA's does."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "ptxas")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho 'ptxas: NVIDIA (R) Ptx optimizing assembler'\n"
                f"echo 'Cuda compilation tools, release {version}, V{version}.1'\n")
    os.chmod(path, 0o755)
    return path


@pytest.fixture
def no_system_toolkit(monkeypatch, tmp_path):
    """Hides this machine's own CUDA toolkit: only the stand-ins of a test are found."""
    monkeypatch.setattr(ptxas, "DEFAULT_TOOLKIT_BIN", str(tmp_path / "nowhere"))
    return {"PATH": str(tmp_path / "empty-path")}


def _bundled_plus(minor_steps: int) -> str:
    major, minor = map(int, ptxas.triton_bundled().version.split("."))
    return f"{major + minor_steps}.{minor}"


def test_default_and_triton_leave_triton_alone(no_system_toolkit, tmp_path):
    env = dict(no_system_toolkit, CUDA_HOME=str(tmp_path / "cuda"))
    _fake_ptxas(tmp_path / "cuda" / "bin", _bundled_plus(1))
    assert ptxas.resolve(env) is None
    assert ptxas.resolve(dict(env, TE_FUSED_MOE_PTXAS="triton")) is None


def test_auto_takes_a_newer_interleaving_toolkit_ptxas(no_system_toolkit, tmp_path):
    newer = _fake_ptxas(tmp_path / "cuda" / "bin", _bundled_plus(1))
    env = dict(no_system_toolkit, CUDA_HOME=str(tmp_path / "cuda"), TE_FUSED_MOE_PTXAS="auto")
    chosen = ptxas.resolve(env)
    assert chosen is not None and chosen.path == newer and chosen.interleaves_ffma
    # found next to nvcc on the PATH as well
    nvcc_dir = tmp_path / "toolkit2" / "bin"
    _fake_ptxas(nvcc_dir, _bundled_plus(2))
    (nvcc_dir / "nvcc").write_text("#!/bin/sh\n")
    (nvcc_dir / "nvcc").chmod(0o755)
    chosen = ptxas.resolve(dict(no_system_toolkit, PATH=str(nvcc_dir), TE_FUSED_MOE_PTXAS="auto"))
    assert chosen is not None and chosen.path == str(nvcc_dir / "ptxas")


def test_auto_keeps_triton_s_when_the_toolkit_is_old_or_absent(no_system_toolkit, tmp_path):
    _fake_ptxas(tmp_path / "cuda" / "bin", "12.4")
    assert ptxas.resolve(dict(no_system_toolkit, CUDA_HOME=str(tmp_path / "cuda"), TE_FUSED_MOE_PTXAS="auto")) is None
    assert ptxas.resolve(dict(no_system_toolkit, TE_FUSED_MOE_PTXAS="auto")) is None


def test_toolkit_demands_an_interleaving_ptxas(no_system_toolkit, tmp_path):
    with pytest.raises(ValueError, match=r"TE_FUSED_MOE_PTXAS=toolkit: expected a CUDA toolkit ptxas >= 12\.9 .*"
                                         r"no CUDA toolkit ptxas was found \(looked at "):
        ptxas.resolve(dict(no_system_toolkit, TE_FUSED_MOE_PTXAS="toolkit"))
    old = _fake_ptxas(tmp_path / "cuda" / "bin", "12.4")
    with pytest.raises(ValueError, match=rf"the CUDA toolkit's ptxas \({old}\) is 12\.4"):
        ptxas.resolve(dict(no_system_toolkit, CUDA_HOME=str(tmp_path / "cuda"), TE_FUSED_MOE_PTXAS="toolkit"))


def test_a_path_must_be_a_ptxas(no_system_toolkit, tmp_path):
    path = _fake_ptxas(tmp_path / "mine", "12.4")  # a path is taken as it is, whatever its version
    assert ptxas.resolve(dict(no_system_toolkit, TE_FUSED_MOE_PTXAS=path)).version == "12.4"
    not_ptxas = tmp_path / "mine" / "notes.txt"
    not_ptxas.write_text("hello")
    for bad in (str(not_ptxas), str(tmp_path / "missing"), "cuda"):
        with pytest.raises(ValueError, match=r"TE_FUSED_MOE_PTXAS: expected one of 'triton', 'auto', 'toolkit' or the "
                                             r"path of a ptxas, got .*no ptxas answers '--version' there"):
            ptxas.resolve(dict(no_system_toolkit, TE_FUSED_MOE_PTXAS=bad))


def test_a_different_triton_ptxas_path_conflicts(no_system_toolkit, tmp_path):
    mine = _fake_ptxas(tmp_path / "a", _bundled_plus(1))
    other = _fake_ptxas(tmp_path / "b", _bundled_plus(1))
    triton_var = ptxas.triton_env()  # TRITON_PTXAS_PATH in Triton 3.6
    env = dict(no_system_toolkit, TE_FUSED_MOE_PTXAS=mine, **{triton_var: other})
    with pytest.raises(ValueError, match=rf"{triton_var} already names .*: set one of them"):
        ptxas.resolve(env)
    assert ptxas.resolve(dict(env, **{triton_var: mine})).path == mine


def _in_fresh_process(code: str, env: dict) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH", "TE_FUSED_MOE_PTXAS")}
    full_env.update(env, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=300)


def test_importing_the_backend_points_triton_at_the_choice(tmp_path):
    chosen = _fake_ptxas(tmp_path / "cuda" / "bin", _bundled_plus(1))
    code = ("import os, te_fused_moe.backends.triton\nfrom te_fused_moe.backends.triton import ptxas\n"
            "used = ptxas.in_use()\nprint('PTXAS', used.path, used.version, os.environ[ptxas.triton_env()])")
    proc = _in_fresh_process(code, {"TE_FUSED_MOE_PTXAS": chosen})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("PTXAS")][-1].split()
    assert line[1:] == [chosen, _bundled_plus(1), chosen]
    # a bad setting fails the import, naming the variable
    proc = _in_fresh_process("import te_fused_moe.backends.triton", {"TE_FUSED_MOE_PTXAS": str(tmp_path / "none")})
    assert proc.returncode != 0 and "TE_FUSED_MOE_PTXAS: expected one of" in proc.stderr


def test_no_switch_once_triton_has_read_a_version(tmp_path, monkeypatch):
    """Triton reads its ptxas's version once per process and keys its kernel cache by it: switching
    after that would file new builds under the old version."""
    chosen = _fake_ptxas(tmp_path / "cuda" / "bin", _bundled_plus(1))
    monkeypatch.setattr(ptxas, "_triton_has_read_a_ptxas_version", lambda: True)
    env = {"PATH": str(tmp_path), "TE_FUSED_MOE_PTXAS": chosen}
    with pytest.raises(RuntimeError, match=r"Triton has already compiled with .* set TE_FUSED_MOE_PTXAS \(or "
                                           rf"{ptxas.triton_env()}\) before the first Triton compile"):
        ptxas.apply(env)
    assert ptxas.triton_env() not in env


def _as_in_triton_3_9(monkeypatch):
    """Triton 3.9's compiler on the installed Triton: ``get_ptxas(arch)`` answers
    ``knobs.nvidia.ptxas_blackwell`` for every arch >= 90 (3.6: ``knobs.nvidia.ptxas`` below 100)."""
    from triton import knobs
    from triton.backends.nvidia import compiler

    monkeypatch.setattr(compiler, "get_ptxas",
                        lambda arch: knobs.nvidia.ptxas_blackwell if arch >= 90 else knobs.nvidia.ptxas)


def test_the_choice_goes_to_the_knob_triton_compiles_sm90_with(no_system_toolkit, tmp_path, monkeypatch):
    """Under Triton 3.9's compiler (:func:`_as_in_triton_3_9`) the choice must land on
    ``knobs.nvidia.ptxas_blackwell`` and its variable, else sm_90 keeps Triton's own ptxas."""
    from triton import knobs

    _as_in_triton_3_9(monkeypatch)
    monkeypatch.setattr(ptxas, "_triton_has_read_a_ptxas_version", lambda: False)
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)  # restored after the test
    assert (ptxas.sm90_knob(), ptxas.triton_env()) == ("ptxas_blackwell", "TRITON_PTXAS_BLACKWELL_PATH")
    assert ptxas.triton_bundled().path.endswith("ptxas-blackwell")
    chosen = _fake_ptxas(tmp_path / "mine", _bundled_plus(1))
    env = dict(no_system_toolkit, TE_FUSED_MOE_PTXAS=chosen)
    try:
        assert ptxas.apply(env).path == chosen
        assert ptxas.in_use().path == chosen and knobs.nvidia.ptxas.path != chosen
        assert env["TRITON_PTXAS_BLACKWELL_PATH"] == chosen and "TRITON_PTXAS_PATH" not in env
    finally:
        del knobs.nvidia.ptxas_blackwell
    other = _fake_ptxas(tmp_path / "other", _bundled_plus(1))
    with pytest.raises(ValueError, match=r"TRITON_PTXAS_BLACKWELL_PATH already names .*: set one of them"):
        ptxas.resolve(dict(env, TRITON_PTXAS_BLACKWELL_PATH=other))


def test_the_sm90_knob_is_told_apart_where_both_knobs_name_one_file(tmp_path, monkeypatch):
    """TRITON_PTXAS_PATH and TRITON_PTXAS_BLACKWELL_PATH may name the same ptxas (how Triton 3.9 runs with
    the CUDA toolkit's): which knob sm_90 reads is then asked of get_ptxas itself, not read off the paths,
    and the knobs are left as they were."""
    import triton
    from triton import knobs

    same = _fake_ptxas(tmp_path / "cuda" / "bin", _bundled_plus(1))
    monkeypatch.setenv("TRITON_PTXAS_PATH", same)
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", same)
    descriptors = dict(type(knobs.nvidia).__dict__)
    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    checked = {(3, 6): "ptxas", (3, 9): "ptxas_blackwell"}  # the releases whose compiler was read (CI: 3.6)
    if version in checked:
        assert ptxas.sm90_knob() == checked[version]
    _as_in_triton_3_9(monkeypatch)
    assert ptxas.sm90_knob() == "ptxas_blackwell" and ptxas.in_use().path == same
    assert all(type(knobs.nvidia).__dict__[name] is descriptors[name] for name in ("ptxas", "ptxas_blackwell"))
    assert knobs.nvidia.ptxas.path == same and knobs.nvidia.ptxas_blackwell.path == same
