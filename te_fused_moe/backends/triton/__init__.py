"""Triton backend: the fused, sync-free expert MLP tuned for Hopper (sm_90).

Modules: ``schedule`` (device-side tile schedule), ``act_math`` (activation math in Triton),
``grouped_gemm`` (FC1/FC2/dgrad kernels with epilogues), ``wgrad`` (variable-K grouped GEMM with
fused bias gradients), ``autograd`` (the ``torch.autograd.Function``), ``ptxas`` (which ptxas builds
the kernels: ``TE_FUSED_MOE_PTXAS``). The block-scaled FP8 recipes share ``block_scaled`` (their
autograd Function) and ``block_scaled_launch`` (host-side launch helpers); their kernels live in
``fp8_block/`` (``Float8BlockScaling``: FP8 wgmma with per-128-block scale promotion) and ``mxfp8/``
(``MXFP8BlockScaling``: operands expanded exactly to BF16 for a BF16 wgmma), both with quantizing
epilogues; ``nvfp4/`` (``NVFP4BlockScaling``: E2M1 operands expanded exactly to BF16, per-expert
tensor scales from separate amax passes) has its own autograd Function.

On CPU tensors it runs only under Triton's interpreter (``TRITON_INTERPRET=1``, used by the tests).
"""

from __future__ import annotations

import os

import torch

from ..base import Availability, Backend, ExpertMLPArgs

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def _triton_import_error():
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"{type(exc).__name__}: {exc}"
    return None


class TritonBackend(Backend):
    name = "triton"

    def availability(self, device: torch.device) -> Availability:
        device = torch.device(device)
        error = _triton_import_error()
        if error is not None:
            return Availability(False, f"backend='triton' needs the triton package ({error})")
        if device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET", "0") == "1":
                return Availability(True, "CPU via the Triton interpreter (TRITON_INTERPRET=1; tests only, slow)")
            return Availability(False, "backend='triton' needs a CUDA GPU (or TRITON_INTERPRET=1 for the CPU interpreter)")
        if device.type != "cuda":
            return Availability(False, f"backend='triton' needs a CUDA GPU, got device {device}")
        if not torch.cuda.is_available():
            return Availability(False, "backend='triton' needs a CUDA GPU, but torch.cuda is not available")
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            return Availability(
                False,
                f"backend='triton' needs compute capability >= 9.0 (tuned for Hopper sm_90; sm_{major}{minor} is "
                f"untested), got sm_{major}{minor}",
            )
        return Availability(True, f"tuned for Hopper sm_90 (running on sm_{major}{minor})")

    def supports(self, activation, recipe, dtype) -> Availability:
        if dtype not in SUPPORTED_DTYPES:
            return Availability(
                False, f"backend='triton' needs bfloat16 or float16 tensors, got {dtype} (use backend='reference')"
            )
        recipe_name = getattr(recipe, "name", None) or type(recipe).__name__
        kernels = _block_scaled_kernels(recipe)
        if kernels is not None:
            reason = kernels.unsupported(recipe)
            if reason is not None:
                return Availability(False, reason)
        elif not _is_bf16_recipe(recipe):
            return Availability(
                False,
                f"backend='triton' implements the bf16, fp8_block (Float8BlockScaling), mxfp8 (MXFP8BlockScaling) "
                f"and nvfp4 (NVFP4BlockScaling) recipes, got {recipe_name} (use backend='reference')",
            )
        from .act_math import ACT_IDS

        if activation.name not in ACT_IDS:
            return Availability(False, f"backend='triton' does not implement activation {activation.name!r}")
        return Availability(True)

    def supports_args(self, args: ExpertMLPArgs) -> Availability:
        """Shape limits of a call (after :meth:`supports`): none. Every recipe takes any hidden / FFN
        size; the block-scaled ones run sizes off their 128 tile on zero-padded operands."""
        return Availability(True)

    def forward(self, args: ExpertMLPArgs) -> torch.Tensor:
        kernels = _block_scaled_kernels(args.recipe)
        if kernels is not None:
            return kernels.expert_mlp(args)
        from .autograd import TritonExpertMLP

        return TritonExpertMLP.apply(
            args.x, args.tokens_per_expert, args.w1, args.w2, args.b1, args.b2, args.probs, args.activation,
            bool(args.deterministic),
        )


def _is_bf16_recipe(recipe) -> bool:
    if recipe is None:
        return True
    from ...recipes import BF16Recipe

    return isinstance(recipe, BF16Recipe)


def _block_scaled_kernels(recipe):
    """The kernels of a block-scaled recipe (``block_scaled.RecipeKernels`` or ``nvfp4.autograd.NVFP4Kernels``), or None (BF16)."""
    from ...recipes import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

    if isinstance(recipe, NVFP4BlockScaling):
        from .nvfp4.autograd import KERNELS

        return KERNELS
    if isinstance(recipe, Float8BlockScaling):
        from .fp8_block.autograd import KERNELS

        return KERNELS
    if isinstance(recipe, MXFP8BlockScaling):
        from .mxfp8.autograd import KERNELS

        return KERNELS
    return None


BACKEND = TritonBackend()

# The ptxas choice (ptxas.py) must precede every Triton compile of the process: this package's kernel
# modules all import through here. Triton is imported only when a choice is asked for.
if os.environ.get("TE_FUSED_MOE_PTXAS", "triton").strip() not in ("", "triton") and _triton_import_error() is None:
    from . import ptxas as _ptxas

    _ptxas.apply()
