"""What a backend is: the interface every implementation of the expert MLP provides.

Backends never import the module layer (``te_fused_moe.module``) nor Megatron/TE glue; they get
validated tensors in :class:`ExpertMLPArgs` and return a differentiable output.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import NamedTuple, Optional

import torch

from ..activations import ActivationConfig
from ..recipes import Recipe


class Availability(NamedTuple):
    """Whether something can run, and if not, a sentence saying why."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:  # so ``if backend.availability(dev):`` reads naturally
        return self.ok


@dataclasses.dataclass
class ExpertMLPArgs:
    """Validated inputs of one expert-MLP call (see :func:`te_fused_moe.fused_moe_mlp`)."""

    x: torch.Tensor  # [T, H], rows grouped by expert
    tokens_per_expert: torch.Tensor  # [E] int, on x.device
    w1: torch.Tensor  # [E, N1, H], N1 = 2F (gated) or F
    w2: torch.Tensor  # [E, H, F]
    activation: ActivationConfig
    recipe: Recipe
    b1: Optional[torch.Tensor] = None  # [E, N1]
    b2: Optional[torch.Tensor] = None  # [E, H]
    probs: Optional[torch.Tensor] = None  # [T], multiplies the activation row-wise
    deterministic: bool = False

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.x.shape[1]

    @property
    def ffn_hidden_size(self) -> int:
        return self.w2.shape[2]


class Backend(abc.ABC):
    """One implementation of the expert MLP."""

    name: str = "base"

    @abc.abstractmethod
    def availability(self, device: torch.device) -> Availability:
        """Can this backend run on ``device`` at all (GPU architecture, installed packages)?"""

    @abc.abstractmethod
    def supports(self, activation: ActivationConfig, recipe: Recipe, dtype: torch.dtype) -> Availability:
        """Does it implement this activation / recipe / parameter dtype?"""

    @abc.abstractmethod
    def forward(self, args: ExpertMLPArgs) -> torch.Tensor:
        """Compute ``y [T, H]``, differentiable w.r.t. x, w1, w2, b1, b2 and probs."""
