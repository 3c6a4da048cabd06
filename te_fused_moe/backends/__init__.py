"""Backend registry: name -> backend, and the ``auto`` choice for a device.

``auto`` picks, in order: ``cudnn`` (cuDNN Frontend's CuTe-DSL kernels, SM100+), ``triton`` (our
kernels, Hopper SM90 and later), then ``reference`` (pure PyTorch, any device). The first that
can run the device, activation and recipe wins; when ``auto`` lands on ``reference`` on a GPU it
says why the fast backends were passed over (once per reason).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Dict, List, Tuple

import torch

from .base import Availability, Backend, ExpertMLPArgs

BACKEND_NAMES = ("reference", "triton", "cudnn")
AUTO_ORDER = ("cudnn", "triton", "reference")

_MODULES = {
    "reference": "te_fused_moe.backends.reference",
    "triton": "te_fused_moe.backends.triton",
    "cudnn": "te_fused_moe.backends.cudnn",
}
_instances: Dict[str, Backend] = {}
_warned: set = set()


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` (one instance per process)."""
    if name not in _MODULES:
        raise ValueError(f"backend: unknown backend {name!r}; expected 'auto' or one of {list(BACKEND_NAMES)}")
    if name not in _instances:
        _instances[name] = importlib.import_module(_MODULES[name]).BACKEND
    return _instances[name]


def explain(device: torch.device, activation, recipe, dtype) -> List[Tuple[str, Availability]]:
    """For each backend, whether it can run here with this activation/recipe/dtype, and why not."""
    report = []
    for name in AUTO_ORDER:
        backend = get_backend(name)
        verdict = backend.availability(device)
        if verdict:
            verdict = backend.supports(activation, recipe, dtype)
        report.append((name, verdict))
    return report


def _supports_args(backend: Backend, args) -> Availability:
    """A backend's optional shape check of one call (``supports_args``); passes when either is absent."""
    check = getattr(backend, "supports_args", None)
    if args is None or check is None:
        return Availability(True)
    return check(args)


def select_backend(name: str, device: torch.device, activation, recipe, dtype, args: ExpertMLPArgs = None) -> Backend:
    """Resolve ``name`` (or ``"auto"``) to a backend that can run, or raise saying why not.

    With ``args`` (the call's validated inputs) backends may also refuse shapes they do not
    implement: ``auto`` then moves on to the next backend."""
    if name == "auto":
        report = explain(device, activation, recipe, dtype)
        report = [(n, v if not v else _supports_args(get_backend(n), args)) for n, v in report]
        for backend_name, verdict in report:
            if verdict:
                if backend_name == "reference" and device.type == "cuda":
                    reasons = "; ".join(f"{n}: {v.reason}" for n, v in report if not v)
                    if reasons not in _warned:
                        _warned.add(reasons)
                        warnings.warn(
                            f"te_fused_moe: backend='auto' fell back to the unfused PyTorch reference on "
                            f"{torch.cuda.get_device_name(device)} ({reasons})",
                            stacklevel=3,
                        )
                return get_backend(backend_name)
        raise RuntimeError("backend: no backend can run here: " + "; ".join(f"{n}: {v.reason}" for n, v in report))
    backend = get_backend(name)
    verdict = backend.availability(device)
    if not verdict:
        raise RuntimeError(f"backend={name!r} cannot run on {device}: {verdict.reason}")
    verdict = backend.supports(activation, recipe, dtype)
    if verdict:
        verdict = _supports_args(backend, args)
    if not verdict:
        raise ValueError(f"backend={name!r} does not support this call: {verdict.reason}")
    return backend


__all__ = [
    "Availability",
    "Backend",
    "ExpertMLPArgs",
    "BACKEND_NAMES",
    "get_backend",
    "select_backend",
    "explain",
]
