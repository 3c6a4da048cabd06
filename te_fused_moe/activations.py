"""Expert activations: the math every backend must reproduce, with hand-written backwards.

Gated activations (GLU family) take FC1's output ``h = [gate | up]`` of width ``2F``: the first
``F`` columns are the gate, the last ``F`` the up projection. This is Megatron Core's layout for
``linear_fc1`` with ``gated_linear_unit=True`` and ``moe_mlp_glu_interleave_size=None`` (its
``glu()`` does ``torch.chunk(h, 2, dim=-1)`` and applies the activation to the first chunk), so
expert weights load unchanged from ``TEGroupedMLP`` / ``SequentialMLP`` checkpoints.

Definitions (all computed in FP32 by the kernels, then rounded to the output dtype):

- ``swiglu``:          ``silu(g) * u``                      (Megatron: ``F.silu`` + GLU)
- ``geglu``:           ``gelu(g) * u``, exact erf GELU       (Megatron: ``F.gelu`` + GLU)
- ``gpt_oss_swiglu``:  ``g' * sigmoid(alpha * g') * (u' + 1)`` with ``g' = min(g, limit)`` and
  ``u' = clamp(u, -limit, limit)``; ``alpha = 1.702``, ``limit = 7.0`` by default (GPT-OSS;
  cuDNN Frontend calls this one ``"geglu"``). Clamping passes the gradient where the bound is
  not exceeded (``g <= limit``, ``-limit <= u <= limit``), as ``torch.clamp`` does.
- ``srelu``:           ``relu(h) ** 2`` (squared ReLU, not gated)
- ``silu``, ``gelu``:  not gated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Optional

import torch

GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """One activation: its name, whether it is gated, and its forward/backward in PyTorch.

    ``forward(h, alpha, limit) -> a`` and ``backward(h, da, alpha, limit) -> dh``; ``alpha`` and
    ``limit`` are only read by ``gpt_oss_swiglu``.
    """

    name: str
    gated: bool
    forward: Callable[..., torch.Tensor]
    backward: Callable[..., torch.Tensor]


def _split(h: torch.Tensor):
    f = h.shape[-1] // 2
    return h[..., :f], h[..., f:]


def _gelu_and_grad(g: torch.Tensor):
    cdf = 0.5 * (1.0 + torch.erf(g * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * g * g) * (1.0 / math.sqrt(2.0 * math.pi))
    return g * cdf, cdf + g * pdf


def _silu_and_grad(g: torch.Tensor):
    s = torch.sigmoid(g)
    return g * s, s * (1.0 + g * (1.0 - s))


def _swiglu_fwd(h, alpha=None, limit=None):
    g, u = _split(h)
    return torch.nn.functional.silu(g) * u


def _swiglu_bwd(h, da, alpha=None, limit=None):
    g, u = _split(h)
    act, dact = _silu_and_grad(g)
    return torch.cat([da * u * dact, da * act], dim=-1)


def _geglu_fwd(h, alpha=None, limit=None):
    g, u = _split(h)
    return _gelu_and_grad(g)[0] * u


def _geglu_bwd(h, da, alpha=None, limit=None):
    g, u = _split(h)
    act, dact = _gelu_and_grad(g)
    return torch.cat([da * u * dact, da * act], dim=-1)


def _gpt_oss_fwd(h, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT):
    g, u = _split(h)
    g = g.clamp(max=limit)
    u = u.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


def _gpt_oss_bwd(h, da, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT):
    g_raw, u_raw = _split(h)
    g = g_raw.clamp(max=limit)
    u = u_raw.clamp(-limit, limit)
    s = torch.sigmoid(alpha * g)
    glu = g * s
    dglu = s * (1.0 + alpha * g * (1.0 - s))
    dg = torch.where(g_raw <= limit, da * (u + 1.0) * dglu, torch.zeros_like(da))
    du = torch.where((u_raw >= -limit) & (u_raw <= limit), da * glu, torch.zeros_like(da))
    return torch.cat([dg, du], dim=-1)


def _srelu_fwd(h, alpha=None, limit=None):
    r = torch.relu(h)
    return r * r


def _srelu_bwd(h, da, alpha=None, limit=None):
    return da * 2.0 * torch.relu(h)


def _silu_fwd(h, alpha=None, limit=None):
    return torch.nn.functional.silu(h)


def _silu_bwd(h, da, alpha=None, limit=None):
    return da * _silu_and_grad(h)[1]


def _gelu_fwd(h, alpha=None, limit=None):
    return _gelu_and_grad(h)[0]


def _gelu_bwd(h, da, alpha=None, limit=None):
    return da * _gelu_and_grad(h)[1]


ACTIVATIONS: Dict[str, ActivationSpec] = {
    spec.name: spec
    for spec in (
        ActivationSpec("swiglu", True, _swiglu_fwd, _swiglu_bwd),
        ActivationSpec("geglu", True, _geglu_fwd, _geglu_bwd),
        ActivationSpec("gpt_oss_swiglu", True, _gpt_oss_fwd, _gpt_oss_bwd),
        ActivationSpec("srelu", False, _srelu_fwd, _srelu_bwd),
        ActivationSpec("silu", False, _silu_fwd, _silu_bwd),
        ActivationSpec("gelu", False, _gelu_fwd, _gelu_bwd),
    )
}


def get_activation(name: str) -> ActivationSpec:
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ValueError(f"activation: unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
    """An activation plus its parameters (only ``gpt_oss_swiglu`` reads ``alpha``/``limit``)."""

    name: str = "swiglu"
    alpha: float = GPT_OSS_ALPHA
    limit: float = GPT_OSS_LIMIT

    def __post_init__(self) -> None:
        get_activation(self.name)
        if not (self.limit > 0 and math.isfinite(self.limit)):
            raise ValueError(f"activation limit: expected a finite positive number, got {self.limit}")

    @property
    def spec(self) -> ActivationSpec:
        return get_activation(self.name)

    @property
    def gated(self) -> bool:
        return self.spec.gated

    @property
    def launch_args(self) -> dict:
        """The activation's keyword arguments of the Triton backend's GEMM ``launch`` functions."""
        return dict(activation=self.name, alpha=self.alpha, limit=self.limit, gated=self.gated)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.spec.forward(h, alpha=self.alpha, limit=self.limit)

    def backward(self, h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
        return self.spec.backward(h, da, alpha=self.alpha, limit=self.limit)


class _ActivationFunction(torch.autograd.Function):
    """Applies an activation with its hand-written backward (computed in FP32)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, config: ActivationConfig):
        ctx.save_for_backward(h)
        ctx.config = config
        compute = h if h.dtype == torch.float64 else h.float()
        return config.forward(compute).to(h.dtype)

    @staticmethod
    def backward(ctx, da: torch.Tensor):
        (h,) = ctx.saved_tensors
        compute = torch.float64 if h.dtype == torch.float64 else torch.float32
        dh = ctx.config.backward(h.to(compute), da.to(compute))
        return dh.to(h.dtype), None


def apply_activation(h: torch.Tensor, config: Optional[ActivationConfig] = None) -> torch.Tensor:
    """Differentiable activation using the hand-written backward above."""
    return _ActivationFunction.apply(h, config or ActivationConfig())
