"""The op: ``fused_moe_mlp`` — argument checks, then the chosen backend.

Checks here read only tensor metadata (shapes, dtypes, devices, strides), so they never make the
host wait for the GPU. Checks that must read GPU data (counts non-negative, counts summing to at
most ``T``) run only in debug mode: ``TE_FUSED_MOE_DEBUG=1`` in the environment or
:func:`set_debug_mode`.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from .activations import ActivationConfig
from .backends import ExpertMLPArgs, select_backend
from .recipes import RecipeLike, as_recipe

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
COUNT_DTYPES = (torch.int32, torch.int64)

_debug_override: Optional[bool] = None


def set_debug_mode(enabled: Optional[bool]) -> None:
    """Force debug checks on/off; ``None`` returns control to ``TE_FUSED_MOE_DEBUG``."""
    global _debug_override
    _debug_override = enabled


def debug_mode() -> bool:
    if _debug_override is not None:
        return _debug_override
    return os.environ.get("TE_FUSED_MOE_DEBUG", "0") not in ("", "0", "false", "False")


def _require_tensor(name: str, value, ndim: int, shape_doc: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape {shape_doc}, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name}: expected shape {shape_doc}, got {tuple(value.shape)}")


def _require_contiguous(name: str, value: torch.Tensor) -> None:
    if not value.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {value.stride()} (call .contiguous())")


def _require_same_device(name: str, value: torch.Tensor, device: torch.device) -> None:
    if value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got one on {value.device}")


def _require_dtype(name: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    if value.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (the dtype of x), got {value.dtype}")


def validate_inputs(args: ExpertMLPArgs) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument for any malformed input."""
    x, counts, w1, w2 = args.x, args.tokens_per_expert, args.w1, args.w2
    _require_tensor("x", x, 2, "[T, H]")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x: expected a floating dtype in {[str(d) for d in FLOAT_DTYPES]}, got {x.dtype}")
    _require_contiguous("x", x)
    tokens, hidden = x.shape
    if hidden == 0:
        raise ValueError(f"x: expected at least one column (H >= 1), got shape {tuple(x.shape)}")
    device = x.device

    _require_tensor("w2", w2, 3, "[E, H, F]")
    experts, _, ffn = w2.shape
    if experts == 0:  # the kernels' schedules have one group per expert plus padding
        raise ValueError(f"w2: expected at least one expert (E >= 1), got shape {tuple(w2.shape)}")
    if ffn == 0:
        raise ValueError(f"w2: expected an FFN width of at least 1 (F >= 1), got shape {tuple(w2.shape)}")
    _require_tensor("w1", w1, 3, "[E, 2F, H] (gated) or [E, F, H]")
    n1 = 2 * ffn if args.activation.gated else ffn
    if tuple(w1.shape) != (experts, n1, hidden):
        layout = "[E, 2F, H] for a gated activation" if args.activation.gated else "[E, F, H]"
        raise ValueError(
            f"w1: expected shape {(experts, n1, hidden)} ({layout}, activation={args.activation.name!r}, "
            f"E and F from w2 {tuple(w2.shape)}, H from x), got {tuple(w1.shape)}"
        )
    if w2.shape[1] != hidden:
        raise ValueError(f"w2: expected shape [E, H, F] with H={hidden} (from x), got {tuple(w2.shape)}")
    for name, weight in (("w1", w1), ("w2", w2)):
        _require_same_device(name, weight, device)
        _require_dtype(name, weight, x.dtype)
        _require_contiguous(name, weight)

    _require_tensor("tokens_per_expert", counts, 1, "[E]")
    if counts.dtype not in COUNT_DTYPES:
        raise TypeError(f"tokens_per_expert: expected an int32 or int64 tensor, got {counts.dtype}")
    if counts.shape[0] != experts:
        raise ValueError(
            f"tokens_per_expert: expected {experts} entries (one per expert, E from w1/w2), got {counts.shape[0]}"
        )
    _require_same_device("tokens_per_expert", counts, device)
    _require_contiguous("tokens_per_expert", counts)  # kernels read it as a flat array on the device

    for name, bias, shape in (("b1", args.b1, (experts, n1)), ("b2", args.b2, (experts, hidden))):
        if bias is None:
            continue
        _require_tensor(name, bias, 2, str(list(shape)))
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(bias.shape)}")
        _require_same_device(name, bias, device)
        _require_dtype(name, bias, x.dtype)
        _require_contiguous(name, bias)

    if args.probs is not None:
        probs = args.probs
        if not isinstance(probs, torch.Tensor):
            raise TypeError(f"probs: expected a torch.Tensor of shape [T], got {type(probs).__name__}")
        if tuple(probs.shape) != (tokens,):
            raise ValueError(f"probs: expected shape ({tokens},) (one per row of x), got {tuple(probs.shape)}")
        if not probs.is_floating_point():
            raise TypeError(f"probs: expected a floating dtype, got {probs.dtype}")
        _require_same_device("probs", probs, device)
        _require_contiguous("probs", probs)

    if debug_mode():
        check_counts(counts, tokens)


def check_counts(counts: torch.Tensor, tokens: int) -> None:
    """Debug-only: reads ``counts`` on the host (a device sync)."""
    values = counts.detach().cpu()
    if bool((values < 0).any()):
        bad = int(torch.nonzero(values < 0)[0, 0])
        raise ValueError(f"tokens_per_expert: counts must be >= 0, expert {bad} has {int(values[bad])}")
    total = int(values.sum())
    if total > tokens:
        raise ValueError(f"tokens_per_expert: counts sum to {total}, more than the {tokens} rows of x")


def fused_moe_mlp(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: Union[str, ActivationConfig] = "swiglu",
    recipe: RecipeLike = None,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    backend: str = "auto",
    deterministic: bool = False,
) -> torch.Tensor:
    """The expert MLP of a MoE layer on tokens already grouped by expert.

    ``y[r] = (act(x[r] @ w1[e].T + b1[e]) * probs[r]) @ w2[e].T + b2[e]`` for each row ``r`` among
    the rows of expert ``e``: expert ``e`` owns rows ``[sum(counts[:e]), sum(counts[:e+1]))``.
    Rows past ``sum(counts)`` are padding: their output is zero and they get zero gradient.

    Args:
        x: ``[T, H]`` tokens, each expert's rows contiguous (the token dispatcher's output).
        tokens_per_expert: ``[E]`` int32/int64 counts on ``x``'s device; never read on the host
            except in debug mode.
        w1: ``[E, 2F, H]`` for gated activations (gate rows first, then up rows) or ``[E, F, H]``.
        w2: ``[E, H, F]``.
        activation: a name from :data:`te_fused_moe.activations.ACTIVATIONS` or an
            :class:`~te_fused_moe.activations.ActivationConfig` (for ``gpt_oss_swiglu``'s alpha/limit).
        recipe: ``None``/"bf16", "mxfp8", "nvfp4", "fp8_block", one of our recipe objects or a TE recipe.
        b1, b2: optional biases ``[E, 2F or F]`` and ``[E, H]``.
        probs: optional ``[T]`` router probabilities multiplied into the activation.
        backend: "auto", "reference", "triton" or "cudnn".
        deterministic: bitwise-reproducible results (backends that reduce with atomics switch to an
            ordered reduction).

    Returns:
        ``y``: ``[T, H]`` in ``x.dtype``.
    """
    if isinstance(activation, str):
        activation = ActivationConfig(activation)
    elif not isinstance(activation, ActivationConfig):
        raise TypeError(f"activation: expected a name or ActivationConfig, got {type(activation).__name__}")
    args = ExpertMLPArgs(
        x=x,
        tokens_per_expert=tokens_per_expert,
        w1=w1,
        w2=w2,
        activation=activation,
        recipe=as_recipe(recipe),
        b1=b1,
        b2=b2,
        probs=probs,
        deterministic=deterministic,
    )
    validate_inputs(args)
    chosen = select_backend(backend, x.device, activation, args.recipe, x.dtype, args=args)
    return chosen.forward(args)
