"""Find cuDNN Frontend's fused grouped GEMM entry points, checking each by name and signature.

The entry points are the cached ``*_wrapper_sm100`` functions of
``cudnn.gemm.cutedsl.grouped`` (nvidia-cudnn-frontend >= 1.32). They are experimental upstream, so
every parameter this backend passes is checked against the installed signature and a missing one is
reported by name instead of failing inside a training step. Importing ``cudnn`` pulls in
``cuda-python`` and ``cutlass``; callers only ask for it on an SM100+ GPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from types import SimpleNamespace
from typing import Dict, Tuple, Union

MIN_VERSION = (1, 32)
GROUPED_MODULE = "cudnn.gemm.cutedsl.grouped"

# Entry point -> parameters this backend relies on (a subset of 1.32.0's signatures).
REQUIRED_PARAMETERS: Dict[str, Tuple[str, ...]] = {
    "grouped_gemm_glu_wrapper_sm100": (
        "a_tensor", "sfa_tensor", "padded_offsets", "alpha_tensor", "b_tensor", "sfb_tensor", "bias_tensor",
        "prob_tensor", "norm_const_tensor", "sf_vec_size", "c_dtype", "d_dtype", "act_func", "geglu_alpha", "glu_clamp_max", "glu_clamp_min", "linear_offset",
        "m_aligned", "generate_c",
    ),
    "grouped_gemm_dglu_wrapper_sm100": (
        "a_tensor", "c_tensor", "sfa_tensor", "padded_offsets", "alpha_tensor", "beta_tensor", "prob_tensor",
        "dprob_tensor", "b_tensor", "sfb_tensor", "norm_const_tensor", "sf_vec_size", "m_aligned", "generate_dbias",
        "d_dtype", "act_func", "geglu_alpha", "glu_clamp_max",
        "glu_clamp_min", "linear_offset", "deterministic",
    ),
    "grouped_gemm_wrapper_sm100": (
        "a_tensor", "padded_offsets", "alpha_tensor", "b_tensor", "bias_tensor", "c_dtype", "d_dtype", "m_aligned",
    ),
    "grouped_gemm_wgrad_wrapper_sm100": (
        "a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor", "wgrad_dtype", "sf_vec_size",
        "global_scale_a", "global_scale_b",  # NVFP4 (fp4.py): per-group tensor dequant scales
    ),
    # The MXFP8 path (blockscaled.py): FC2 and FC1 dgrad, and the squared-ReLU pair.
    "grouped_gemm_quant_wrapper_sm100": (
        "a_tensor", "sfa_tensor", "padded_offsets", "alpha_tensor", "b_tensor", "sfb_tensor", "bias_tensor",
        "norm_const_tensor", "d_dtype", "sf_vec_size", "m_aligned", "generate_amax",
    ),
    "grouped_gemm_srelu_wrapper_sm100": (
        "a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "padded_offsets", "alpha_tensor", "bias_tensor",
        "norm_const_tensor", "prob_tensor", "c_dtype", "d_dtype", "sf_vec_size", "m_aligned",
    ),
    "grouped_gemm_dsrelu_wrapper_sm100": (
        "a_tensor", "b_tensor", "c_tensor", "sfa_tensor", "sfb_tensor", "padded_offsets", "alpha_tensor",
        "prob_tensor", "dprob_tensor", "generate_dbias", "norm_const_tensor", "d_dtype", "sf_vec_size", "m_aligned",
        "deterministic",
    ),
}
REQUIRED_CLASSES = ("GroupedGemmGluSm100", "GroupedGemmDgluSm100", "GroupedGemmWgradSm100", "GroupedGemmSm100")


def _parse_version(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def installed_version() -> Union[str, None]:
    try:
        return importlib.metadata.version("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_signatures(namespace) -> Tuple[bool, str]:
    """Whether ``namespace`` has every entry point and class with the parameters we pass."""
    for name, params in REQUIRED_PARAMETERS.items():
        fn = getattr(namespace, name, None)
        if fn is None:
            return False, f"{GROUPED_MODULE}.{name} is missing"
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            return False, f"{GROUPED_MODULE}.{name} has no inspectable signature"
        missing = [p for p in params if p not in signature.parameters]
        if missing:
            return False, f"{GROUPED_MODULE}.{name} lacks parameter(s) {missing}"
    for name in REQUIRED_CLASSES:
        if getattr(namespace, name, None) is None:
            return False, f"{GROUPED_MODULE}.{name} is missing"
    return True, ""


@functools.lru_cache(maxsize=1)
def load() -> Tuple[Union[SimpleNamespace, None], str]:
    """(namespace of the entry points, "") or (None, why not). Imports cuDNN FE once."""
    version = installed_version()
    if version is None:
        return None, "nvidia-cudnn-frontend is not installed (pip install 'nvidia-cudnn-frontend>=1.32')"
    if _parse_version(version) < MIN_VERSION:
        return None, f"nvidia-cudnn-frontend {version} is too old; its fused grouped GEMM API needs >= 1.32"
    try:
        grouped = importlib.import_module(GROUPED_MODULE)
    except Exception as error:  # cuda-python / cutlass DSL missing or broken
        return None, f"cannot import {GROUPED_MODULE} ({type(error).__name__}: {error})"
    namespace = SimpleNamespace(
        **{name: getattr(grouped, name, None) for name in (*REQUIRED_PARAMETERS, *REQUIRED_CLASSES)}
    )
    ok, reason = check_signatures(namespace)
    if not ok:
        return None, f"nvidia-cudnn-frontend {version}: {reason}"
    return namespace, ""
