"""``FusedGroupedMLP``: the expert MLP of a MoE layer as a Transformer-Engine-style torch module.

The module owns the parameters and picks the recipe; the math lives in the op
(:func:`te_fused_moe.fused_moe_mlp`), which picks the backend. One direction of data:
module -> op -> backend, so this file never imports a backend.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from .activations import GPT_OSS_ALPHA, GPT_OSS_LIMIT, ActivationConfig
from .ops import fused_moe_mlp
from .recipes import BF16Recipe, Recipe, RecipeLike, as_recipe

InitMethod = Callable[[torch.Tensor], object]

MEGATRON_INIT_STD = 0.02  # Megatron's default ``init_method_std``


def normal_init_method(std: float = MEGATRON_INIT_STD) -> InitMethod:
    """``tensor -> normal_(tensor, 0, std)``, what Megatron's ``init_method_normal(std)`` does."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def _te_autocast_recipe() -> Optional[Recipe]:
    """The recipe of TE's active autocast (converted to ours), or None when TE's autocast is off or
    our TE bridge is not available."""
    try:
        from . import te_compat

        autocast_recipe = te_compat.autocast_recipe
    except (ImportError, AttributeError):
        return None
    recipe = autocast_recipe()
    return None if recipe is None else as_recipe(recipe)


class FusedGroupedMLP(torch.nn.Module):
    """All experts of one MoE layer: ``y = act(x @ W1[e].T + b1[e]) * probs @ W2[e].T + b2[e]``
    over each expert's contiguous rows, fused and without host synchronisation where a fast
    backend runs.

    Args:
        num_experts: ``E``, experts held by this module (the local experts of an EP rank).
        hidden_size: ``H``, the model width.
        ffn_hidden_size: ``F``, each expert's intermediate width (Megatron's
            ``moe_ffn_hidden_size``); FC1 produces ``2F`` columns for gated activations.
        activation: ``"swiglu"``, ``"geglu"``, ``"gpt_oss_swiglu"``, ``"srelu"``, ``"silu"`` or
            ``"gelu"`` (see :mod:`te_fused_moe.activations`).
        bias: add ``bias1`` after FC1 and ``bias2`` after FC2.
        recipe: quantization recipe (ours, a name such as ``"mxfp8"``, or a TE recipe). ``None``
            means: TE's active ``autocast`` recipe if there is one, else BF16 (no quantization).
            An explicit recipe always wins over TE's autocast.
        backend: ``"auto"``, ``"reference"``, ``"triton"`` or ``"cudnn"``.
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``, as in TE).
        device: where to create parameters (default: PyTorch's current default device).
        init_method: called on each expert's ``weight1[e]`` (default: normal, std 0.02, as
            Megatron's ``init_method_normal``).
        output_layer_init_method: the same for ``weight2[e]`` (default: ``init_method``'s default).
        activation_alpha, activation_limit: ``gpt_oss_swiglu``'s alpha and clamp limit.
        deterministic: ask the backend for bitwise run-to-run reproducible results.

    Parameters are stacked across experts, one tensor per layer:

    ============  ==============  ===========================================================
    state key     shape           meaning
    ============  ==============  ===========================================================
    ``weight1``   ``[E, N1, H]``  FC1, ``N1 = 2F`` (gated: rows ``[:F]`` gate, ``[F:]`` up) or ``F``
    ``weight2``   ``[E, H, F]``   FC2
    ``bias1``     ``[E, N1]``     only with ``bias=True``
    ``bias2``     ``[E, H]``      only with ``bias=True``
    ============  ==============  ===========================================================

    They are stacked because the grouped kernels read one tensor per layer: holding E separate
    parameters would cost a ``torch.stack`` copy of all weights (and of their gradients) every
    step. Per-expert views (``weight1[e]``, ``weight2[e]``) are what checkpoint converters use;
    ``weight1[e]`` is laid out as Megatron's ``linear_fc1.weight{e}`` of ``TEGroupedMLP`` (gate
    rows then up rows), ``weight2[e]`` as ``linear_fc2.weight{e}``.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        bias: bool = False,
        recipe: RecipeLike = None,
        backend: str = "auto",
        params_dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
        init_method: Optional[InitMethod] = None,
        output_layer_init_method: Optional[InitMethod] = None,
        activation_alpha: float = GPT_OSS_ALPHA,
        activation_limit: float = GPT_OSS_LIMIT,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.activation = ActivationConfig(activation, alpha=activation_alpha, limit=activation_limit)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.use_bias = bias
        # Resolved now so a bad name fails at construction; None defers to TE's autocast per call.
        self.recipe: Optional[Recipe] = None if recipe is None else as_recipe(recipe)
        self.backend = backend
        self.deterministic = deterministic
        self.init_method = init_method or normal_init_method()
        self.output_layer_init_method = output_layer_init_method or normal_init_method()

        params_dtype = params_dtype or torch.get_default_dtype()
        n1 = 2 * ffn_hidden_size if self.activation.gated else ffn_hidden_size
        factory = dict(dtype=params_dtype, device=device)
        self.weight1 = torch.nn.Parameter(torch.empty(num_experts, n1, hidden_size, **factory))
        self.weight2 = torch.nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, **factory))
        if bias:
            self.bias1 = torch.nn.Parameter(torch.empty(num_experts, n1, **factory))
            self.bias2 = torch.nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        else:
            self.register_parameter("bias1", None)
            self.register_parameter("bias2", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise each expert's slice on its own (as ``TEGroupedMLP`` does for its E
        separate weights); biases start at zero."""
        with torch.no_grad():
            for e in range(self.num_experts):
                self.init_method(self.weight1[e])
                self.output_layer_init_method(self.weight2[e])
            if self.bias1 is not None:
                self.bias1.zero_()
                self.bias2.zero_()

    def active_recipe(self) -> Recipe:
        """The recipe the next forward uses: the explicit one, else TE's autocast, else BF16."""
        if self.recipe is not None:
            return self.recipe
        return _te_autocast_recipe() or BF16Recipe()

    def forward(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``x [T, H]`` with each expert's rows contiguous, ``tokens_per_expert [E]`` (int, on
        ``x``'s device, not read on the host), optional router ``probs [T]`` -> ``y [T, H]``."""
        return fused_moe_mlp(
            x,
            tokens_per_expert,
            self.weight1,
            self.weight2,
            activation=self.activation,
            recipe=self.active_recipe(),
            b1=self.bias1,
            b2=self.bias2,
            probs=probs,
            backend=self.backend,
            deterministic=self.deterministic,
        )

    def extra_repr(self) -> str:
        recipe = self.recipe.name if self.recipe is not None else "auto (TE autocast, else bf16)"
        parts = [
            f"num_experts={self.num_experts}",
            f"hidden_size={self.hidden_size}",
            f"ffn_hidden_size={self.ffn_hidden_size}",
            f"activation={self.activation.name!r}",
            f"bias={self.use_bias}",
            f"recipe={recipe}",
            f"backend={self.backend!r}",
            f"params_dtype={self.weight1.dtype}",
        ]
        if self.activation.name == "gpt_oss_swiglu":
            parts.append(f"alpha={self.activation.alpha}, limit={self.activation.limit}")
        if self.deterministic:
            parts.append("deterministic=True")
        return ", ".join(parts)


__all__ = ["FusedGroupedMLP", "normal_init_method"]
