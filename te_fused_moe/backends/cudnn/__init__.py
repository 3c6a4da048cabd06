"""``backend="cudnn"``: cuDNN Frontend's CuTe-DSL fused grouped GEMM kernels (Blackwell, SM100+).

Forward: one GLU kernel (FC1 grouped GEMM + bias + GLU + router prob) then one grouped GEMM (FC2 +
bias). Backward: one dGLU kernel (FC2 dgrad + dGLU + dprob + dbias1), one grouped GEMM (FC1 dgrad)
and two grouped wgrad GEMMs. Layouts are prepared on the device (see :mod:`.layouts`); the kernels
read the group offsets on the device, so nothing syncs with the host.

What runs where:

* Only CUDA devices with compute capability major >= 10 and nvidia-cudnn-frontend >= 1.32 whose
  entry points pass :func:`.api.check_signatures`. On Hopper (sm_90) ``backend="auto"`` uses our
  Triton kernels instead.
* Activations: ``swiglu`` and ``gpt_oss_swiglu`` (cuDNN's ``"geglu"``: clamped, alpha 1.702,
  limit 7, +1 on up), and ``srelu`` with MXFP8 only (its kernels take block-scaled operands only).
  cuDNN FE has no plain GeGLU, SiLU or GELU kernels.
* Recipes: BF16 (:mod:`.kernels`), MXFP8 with E4M3 for every role (:mod:`.blockscaled`; the
  kernels need A and B of one dtype, so HYBRID is refused) and NVFP4 for the GLU activations
  (:mod:`.fp4`: per-expert tensor scales, our quantizer for every operand; ``deterministic=True``
  refused). None of this has run on SM100 hardware (docs/te_cudnn.md).
"""

from __future__ import annotations

import torch

from ...activations import GPT_OSS_ALPHA, GPT_OSS_LIMIT, ActivationConfig
from ...recipes import BF16Recipe, Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling, Recipe
from ..base import Availability, Backend, ExpertMLPArgs
from . import api

MIN_MAJOR = 10
GLU_ACTIVATIONS = {"swiglu": "swiglu", "gpt_oss_swiglu": "geglu"}  # ours -> cuDNN FE's act_func


def _capability_reason(major: int, minor: int) -> str:
    found = f"sm_{major}{minor}"
    reason = f"cuDNN Frontend's fused grouped GEMM kernels need SM100+ (found {found})"
    if major == 9:
        return reason + "; backend='auto' uses 'triton' on Hopper"
    return reason + "; backend='auto' uses the next backend that can run here"


class CudnnBackend(Backend):
    name = "cudnn"

    def availability(self, device: torch.device) -> Availability:
        device = torch.device(device)
        if device.type != "cuda":
            return Availability(False, f"cuDNN Frontend's fused grouped GEMM kernels run on CUDA GPUs, not {device.type}")
        major, minor = torch.cuda.get_device_capability(device)
        if major < MIN_MAJOR:
            return Availability(False, _capability_reason(major, minor))
        namespace, why = api.load()
        if namespace is None:
            return Availability(False, why)
        return Availability(True)

    def supports(self, activation: ActivationConfig, recipe: Recipe, dtype: torch.dtype) -> Availability:
        if activation.name not in GLU_ACTIVATIONS and activation.name != "srelu":
            return Availability(
                False,
                f"activation {activation.name!r}: cuDNN Frontend has fused grouped GEMM kernels only for "
                f"swiglu, gpt_oss_swiglu (its 'geglu') and srelu",
            )
        if activation.name == "gpt_oss_swiglu" and (
            activation.alpha != GPT_OSS_ALPHA or activation.limit != GPT_OSS_LIMIT
        ):
            return Availability(
                False,
                f"gpt_oss_swiglu with alpha={activation.alpha}, limit={activation.limit}: this backend passes "
                f"cuDNN Frontend's GLU kernels alpha={GPT_OSS_ALPHA}, limit={GPT_OSS_LIMIT} only (its BF16 forward "
                f"fixes them)",
            )
        if isinstance(recipe, Float8BlockScaling):
            return Availability(False, "recipe fp8_block: cuDNN Frontend's grouped kernels take MX/NV block scales "
                                       "(1x32/1x16), not 128-element FP8 blocks")
        if isinstance(recipe, NVFP4BlockScaling):
            if activation.name not in GLU_ACTIVATIONS:
                return Availability(
                    False,
                    f"activation {activation.name!r} with recipe nvfp4: backend='cudnn' drives cuDNN Frontend's FP4 "
                    f"kernels for swiglu and gpt_oss_swiglu only (its squared-ReLU wrappers are driven for MXFP8 "
                    f"only); use backend='reference'",
                )
            # Every NVFP4BlockScaling setting (2D weight tiles, RHT, stochastic rounding) is applied by
            # our quantizer before the kernels, which read 1x16 scales only (fp4.py).
        elif isinstance(recipe, MXFP8BlockScaling):
            if recipe.fp8_format is not Format.E4M3:
                return Availability(
                    False,
                    f"recipe mxfp8 with fp8_format={recipe.fp8_format.name}: cuDNN Frontend's block-scaled kernels "
                    f"need A and B of one FP8 dtype, so E5M2 gradients times E4M3 weights cannot run; use E4M3",
                )
        elif not isinstance(recipe, BF16Recipe):
            return Availability(False, f"recipe {recipe.name!r} is not supported by the cudnn backend")
        elif activation.name == "srelu":
            return Availability(
                False,
                "srelu with recipe bf16: cuDNN Frontend's squared-ReLU grouped kernels take only block-scaled "
                "(FP8/FP4) operands; use recipe mxfp8 or another backend",
            )
        if dtype != torch.bfloat16:
            return Availability(False, f"dtype {dtype}: cuDNN Frontend's grouped GEMM kernels take bfloat16 "
                                       f"parameters and write bfloat16 outputs here")
        return Availability(True)

    def supports_args(self, args: ExpertMLPArgs) -> Availability:
        """Limits of one call the kernels impose beyond :meth:`supports` (NVFP4: H, deterministic)."""
        if isinstance(args.recipe, NVFP4BlockScaling):
            from .fp4 import call_limits

            reason = call_limits(args)
            if reason is not None:
                return Availability(False, reason)
        return Availability(True)

    def forward(self, args: ExpertMLPArgs) -> torch.Tensor:
        from .kernels import cudnn_expert_mlp  # imports cuDNN FE only when a call actually runs here

        return cudnn_expert_mlp(args)


BACKEND = CudnnBackend()

__all__ = ["BACKEND", "CudnnBackend"]
