"""Which ptxas turns the Triton backend's PTX into SASS.

Triton 3.6 ships ptxas 12.8. From 12.9 on, ptxas clears the yield hint on every other FFMA of a long
run (the "FFMA interleaving" DeepGEMM used to patch into its SASS by hand), so the warp scheduler may
switch to another warp, such as the one about to issue the next wgmma, while one warp promotes its
block. The FP8 block kernels' per-128-block promotions are such runs (the wgrad: ~640 FFMAs, none
yielding with 12.8, about half with 13.0; offline builds in tests/test_ptxas.py).

``TE_FUSED_MOE_PTXAS`` picks it:

- ``triton`` (the default): Triton's own, or whatever its variable (:func:`triton_env`) names.
- ``auto``: the CUDA toolkit's ptxas where it is >= 12.9 and newer than Triton's, else Triton's.
- ``toolkit``: the CUDA toolkit's ptxas, which must be >= 12.9 (an error otherwise).
- a path: that ptxas.

The toolkit's ptxas is looked for in ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, next to ``nvcc`` on the
PATH, on the PATH, then in ``/usr/local/cuda/bin``. The choice holds for the whole process: Triton
has one ptxas per process, reads its version once and keys its kernel cache by it, so the choice is
made when the Triton backend is imported (``apply``) and refused once Triton has compiled a kernel
with another ptxas. It is written to the knob Triton's compiler reads for sm_90 (:func:`sm90_knob`:
``TRITON_PTXAS_PATH`` in Triton 3.6, ``TRITON_PTXAS_BLACKWELL_PATH`` in 3.9, whose ``get_ptxas`` takes
that one for every arch >= 90), so child processes inherit it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Mapping, Optional

ENV = "TE_FUSED_MOE_PTXAS"
SETTINGS = ("triton", "auto", "toolkit")
INTERLEAVES_FROM = (12, 9)  # the first ptxas that interleaves FFMA yield hints by itself
DEFAULT_TOOLKIT_BIN = "/usr/local/cuda/bin"


@dataclasses.dataclass(frozen=True)
class Ptxas:
    path: str
    version: str  # "major.minor", as Triton reads it

    @property
    def interleaves_ffma(self) -> bool:
        return _version_tuple(self.version) >= INTERLEAVES_FROM


def _version_tuple(version: str) -> tuple:
    return tuple(int(part) for part in version.split("."))


def probe(path: str) -> Optional[Ptxas]:
    """The ptxas at ``path`` with its version (read the way Triton reads it), or None if none answers."""
    from triton.knobs import NvidiaTool

    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return None
    try:
        tool = NvidiaTool.from_path(path)
    except OSError:  # not an executable Triton can run
        return None
    return None if tool is None else Ptxas(tool.path, tool.version)


def sm90_knob() -> str:
    """The ``triton.knobs.nvidia`` attribute whose ptxas Triton's compiler runs for sm_90 (``ptxas`` in
    Triton 3.6, ``ptxas_blackwell`` from 3.9): asked of its ``get_ptxas(90)`` with each knob's descriptor
    briefly replaced by one that answers its own name. (Comparing the knobs' paths cannot tell them apart
    where both name the same file, as TRITON_PTXAS_PATH and TRITON_PTXAS_BLACKWELL_PATH may.)"""
    from triton import knobs
    from triton.backends.nvidia import compiler

    knob_type = type(knobs.nvidia)
    names = [name for name in ("ptxas", "ptxas_blackwell") if name in knob_type.__dict__]
    descriptors = {name: knob_type.__dict__[name] for name in names}
    try:
        for name in names:
            setattr(knob_type, name, property(lambda _, name=name: name))
        used = compiler.get_ptxas(90)
    finally:
        for name, descriptor in descriptors.items():
            setattr(knob_type, name, descriptor)
    if used not in names:
        raise RuntimeError(f"Triton's get_ptxas(90) reads none of knobs.nvidia.{' / '.join(names)}")
    return used


def triton_env(knob: Optional[str] = None) -> str:
    """The environment variable of ``knob`` (default :func:`sm90_knob`: ``TRITON_PTXAS_PATH`` in Triton
    3.6)."""
    from triton import knobs

    return type(knobs.nvidia).__dict__[knob or sm90_knob()].key


def triton_bundled() -> Ptxas:
    """The ptxas in the Triton wheel that Triton compiles sm_90 with."""
    from triton import knobs

    default_path = type(knobs.nvidia).__dict__[sm90_knob()].default_path
    found = probe(default_path)
    if found is None:
        raise RuntimeError(f"the Triton wheel has no working ptxas at {default_path}")
    return found


def toolkit_candidates(environ: Mapping[str, str]) -> list:
    """Where the CUDA toolkit's ptxas may be, in the order looked at."""
    paths = [os.path.join(environ[var], "bin", "ptxas") for var in ("CUDA_HOME", "CUDA_PATH") if environ.get(var)]
    search_path = environ.get("PATH", "")
    nvcc = shutil.which("nvcc", path=search_path)
    if nvcc:
        paths.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "ptxas"))
    on_path = shutil.which("ptxas", path=search_path)
    if on_path:
        paths.append(on_path)
    paths.append(os.path.join(DEFAULT_TOOLKIT_BIN, "ptxas"))
    return paths


def toolkit(environ: Mapping[str, str]) -> Optional[Ptxas]:
    """The first working ptxas of :func:`toolkit_candidates`, or None."""
    for path in toolkit_candidates(environ):
        found = probe(path)
        if found is not None:
            return found
    return None


def resolve(environ: Mapping[str, str]) -> Optional[Ptxas]:
    """The ptxas ``TE_FUSED_MOE_PTXAS`` asks for, or None for Triton's own choice. Raises ValueError for
    a setting that cannot be met."""
    setting = environ.get(ENV, "triton").strip() or "triton"
    if setting == "triton":
        return None
    if setting in ("auto", "toolkit"):
        found = toolkit(environ)
        bundled = triton_bundled()
        usable = (found is not None and found.interleaves_ffma
                  and _version_tuple(found.version) > _version_tuple(bundled.version))
        if setting == "auto":
            return found if usable else None
        if not usable:
            what = ("no CUDA toolkit ptxas was found (looked at " + ", ".join(toolkit_candidates(environ)) + ")"
                    if found is None else f"the CUDA toolkit's ptxas ({found.path}) is {found.version}")
            raise ValueError(f"{ENV}=toolkit: expected a CUDA toolkit ptxas >= "
                             f"{'.'.join(map(str, INTERLEAVES_FROM))} and newer than Triton's "
                             f"({bundled.version}), but {what}")
        chosen = found
    else:
        chosen = probe(setting)
        if chosen is None:
            raise ValueError(f"{ENV}: expected one of {', '.join(repr(s) for s in SETTINGS)} or the path of a "
                             f"ptxas, got {setting!r}: no ptxas answers '--version' there")
    triton_var = triton_env()
    preset = environ.get(triton_var)
    if preset and os.path.realpath(preset) != os.path.realpath(chosen.path):
        raise ValueError(f"{ENV}={setting} chose {chosen.path}, but {triton_var} already names {preset}: "
                         f"set one of them")
    return chosen


def _triton_has_read_a_ptxas_version() -> bool:
    from triton.backends.nvidia import compiler

    return compiler.get_ptxas_version.cache_info().currsize > 0


def in_use() -> Ptxas:
    """The ptxas Triton compiles sm_90 with now."""
    from triton.backends.nvidia import compiler

    tool = compiler.get_ptxas(90)
    return Ptxas(tool.path, tool.version)


def apply(environ: Optional[dict] = None) -> Optional[Ptxas]:
    """Points Triton at the ptxas ``TE_FUSED_MOE_PTXAS`` asks for (None: left as it was)."""
    environ = os.environ if environ is None else environ
    chosen = resolve(environ)
    if chosen is None:
        return None
    current = in_use()
    if os.path.realpath(current.path) == os.path.realpath(chosen.path):
        return chosen
    if _triton_has_read_a_ptxas_version():
        raise RuntimeError(f"{ENV} chose {chosen.path} ({chosen.version}), but Triton has already compiled with "
                           f"{current.path} ({current.version}) in this process and keys its cache by that "
                           f"version: set {ENV} (or {triton_env()}) before the first Triton compile")
    from triton import knobs

    knob = sm90_knob()
    setattr(knobs.nvidia, knob, chosen.path)  # also sets its variable (triton_env) in os.environ
    if environ is not os.environ:
        environ[triton_env(knob)] = chosen.path
    return chosen
