"""Replace the unfused expert blocks of a built model by :class:`~te_fused_moe.FusedGroupedMLP`
carrying the same weights, and put them back.

Two kinds of block are recognised:

1. **TE GroupedLinear blocks.** A module whose direct children include exactly two modules shaped
   like TE's ``transformer_engine.pytorch.GroupedLinear`` (TE 2.x ``module/grouped_linear.py``:
   attributes ``num_gemms``, ``in_features``, ``out_features``, ``use_bias``, ``return_bias`` and one
   2-D parameter ``weight{i}`` of shape ``[out_features, in_features]`` per GEMM, plus ``bias{i}``
   when ``use_bias``). Registration order names them FC1 then FC2. They must agree:
   same ``num_gemms`` (E), ``fc1.in_features == fc2.out_features`` (H), and
   ``fc1.out_features`` equal to ``2 * fc2.in_features`` (gated; rows ``[:F]`` gate, ``[F:]`` up,
   TE's and Megatron's convention) or to ``fc2.in_features`` (not gated). The block must hold no
   other parameters, and must say which activation sits between the two, either as an attribute
   ``activation`` (a name from :data:`te_fused_moe.ACTIVATIONS` or an ``ActivationConfig``) or as
   one child module among: ``torch.nn.SiLU`` (swiglu if gated, else silu), ``torch.nn.GELU`` with
   ``approximate='none'`` (geglu / gelu), and TE op-fuser activations ``SwiGLU`` / ``SReLU`` /
   ``ClampedSwiGLU`` (gpt_oss_swiglu, with its ``alpha``/``limit``, only when
   ``glu_linear_offset == 1`` and ``glu_interleave_size`` is unset). TE's ``GEGLU`` is not mapped:
   TE's GELU is the tanh approximation, ours is exact.

   The swap assumes the block computes ``fc2(act(fc1(x, m_splits)), m_splits)``; the
   replacement is called the same way, ``(x, m_splits[, probs])``, where ``m_splits`` may be a
   tensor (kept on the device) or a list of ints (copied to ``x``'s device, no sync).
   Blocks it cannot honour (bias on one linear only, ``return_bias``, tensor-parallel shards,
   FP8 primary weights, single grouped weight tensors) are left alone and listed in
   :attr:`SwapReport.skipped` with the reason.

2. **Megatron expert modules** (``SequentialMLP``, ``TEGroupedMLP`` from
   ``megatron.core.transformer.moe.experts``): handed to
   :func:`megatron_patches.swap.swap_megatron_experts`, imported only when such a module exists.

Swap before building the optimizer (the new module has new parameter tensors). The original block
is kept, outside the module tree, so :func:`unswap_experts` can restore it with the current
(possibly trained) weights copied back; pass ``keep_original=False`` to let it be freed instead.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional, Tuple, Union

import torch

from .activations import ACTIVATIONS, ActivationConfig
from .module import FusedGroupedMLP
from .recipes import RecipeLike, as_recipe

_ORIGINAL = "_te_fused_moe_original_block"
_MEGATRON_CLASSES = ("SequentialMLP", "TEGroupedMLP")
_MEGATRON_IMPL = {"auto": "fused", "triton": "fused-triton", "cudnn": "fused-cudnn", "reference": "fused-reference"}


@dataclasses.dataclass
class SwapEntry:
    name: str
    replaced: str
    by: str
    num_experts: int


@dataclasses.dataclass
class SwapReport:
    """What was swapped (``entries``) and which look-alike blocks were left alone and why (``skipped``)."""

    entries: List[SwapEntry] = dataclasses.field(default_factory=list)
    skipped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries)

    def __str__(self) -> str:
        lines = [f"{e.name}: {e.replaced} -> {e.by} ({e.num_experts} experts)" for e in self.entries]
        lines += [f"{name}: not swapped ({why})" for name, why in self.skipped]
        return "\n".join(lines) if lines else "no expert blocks found"


# --------------------------------------------------------------------------- detection

def is_grouped_linear(module: torch.nn.Module) -> bool:
    """Duck-typed TE ``GroupedLinear`` (module API, per-GEMM ``weight{i}`` parameters)."""
    num = getattr(module, "num_gemms", None)
    if not isinstance(num, int) or num < 1:
        return False
    if not all(isinstance(getattr(module, a, None), int) for a in ("in_features", "out_features")):
        return False
    return hasattr(module, "use_bias") and (
        isinstance(getattr(module, "weight0", None), torch.Tensor) or getattr(module, "single_grouped_weight", False)
    )


def _grouped_linear_problem(linear: torch.nn.Module) -> Optional[str]:
    if getattr(linear, "single_grouped_weight", False):
        return "single_grouped_weight=True (one GroupedTensor weight) is not supported"
    if getattr(linear, "return_bias", False):
        return "return_bias=True: the block adds the bias itself"
    if getattr(linear, "tp_size", 1) != 1:
        return f"tensor-parallel shard (tp_size={linear.tp_size}); swap the unsharded model or use megatron_patches"
    if getattr(linear, "primary_weights_in_fp8", False):
        return "FP8 primary weights are not supported; build the model with high-precision weights"
    for i in range(linear.num_gemms):
        weight = getattr(linear, f"weight{i}", None)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (linear.out_features, linear.in_features):
            return f"weight{i} is not a [{linear.out_features}, {linear.in_features}] tensor"
        if type(weight) not in (torch.Tensor, torch.nn.Parameter):
            return f"weight{i} is a {type(weight).__name__}, not a plain tensor"
        bias = getattr(linear, f"bias{i}", None)
        if linear.use_bias and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (linear.out_features,)):
            return f"bias{i} is not a [{linear.out_features}] tensor"
    return None


def _activation_from_child(child: torch.nn.Module, gated: bool) -> Optional[Union[ActivationConfig, str]]:
    """An ActivationConfig, a reason string when the child is an activation we cannot honour, or None."""
    name = type(child).__name__
    if isinstance(child, torch.nn.SiLU):
        return ActivationConfig("swiglu" if gated else "silu")
    if isinstance(child, torch.nn.GELU):
        if child.approximate != "none":
            return f"torch.nn.GELU(approximate={child.approximate!r}) is not supported (exact GELU only)"
        return ActivationConfig("geglu" if gated else "gelu")
    if not type(child).__module__.startswith("transformer_engine"):
        return None
    if getattr(child, "glu_interleave_size", None) is not None:
        return f"TE {name} with glu_interleave_size={child.glu_interleave_size} (interleaved FC1 rows)"
    if name == "SwiGLU" and gated:
        return ActivationConfig("swiglu")
    if name == "SReLU" and not gated:
        return ActivationConfig("srelu")
    if name == "ClampedSwiGLU" and gated:
        if float(getattr(child, "glu_linear_offset", 1.0)) != 1.0:
            return f"TE ClampedSwiGLU with glu_linear_offset={child.glu_linear_offset} (ours adds 1)"
        return ActivationConfig("gpt_oss_swiglu", alpha=float(child.alpha), limit=float(child.limit))
    return f"TE activation {name} has no exact te_fused_moe equivalent here"


def _block_activation(block, extra_children, gated) -> Union[ActivationConfig, str]:
    declared = getattr(block, "activation", None)
    if isinstance(declared, str) and declared in ACTIVATIONS:
        declared = ActivationConfig(declared)
    if isinstance(declared, ActivationConfig):
        if declared.gated != gated:
            return (f"activation {declared.name!r} is {'' if declared.gated else 'not '}gated but the FC1/FC2 "
                    f"widths say {'gated' if gated else 'not gated'}")
        return declared
    found = [a for a in (_activation_from_child(c, gated) for c in extra_children) if a is not None]
    configs = [a for a in found if isinstance(a, ActivationConfig)]
    if len(configs) == 1 and len(found) == 1:
        return configs[0]
    if found and not configs:
        return found[0]
    if len(found) > 1:
        return "more than one activation child"
    return "no activation declared (set an `activation` attribute or add an activation child module)"


@dataclasses.dataclass
class _Block:
    fc1: torch.nn.Module
    fc2: torch.nn.Module
    activation: ActivationConfig


def inspect_block(module: torch.nn.Module) -> Union[_Block, str, None]:
    """``_Block`` if ``module`` is a swappable TE expert block, a reason string if it looks like one
    (two GroupedLinear children) but cannot be swapped, else None."""
    children = list(module.named_children())
    linears = [c for _, c in children if is_grouped_linear(c)]
    if len(linears) != 2:
        return None
    fc1, fc2 = linears
    for which, linear in (("fc1", fc1), ("fc2", fc2)):
        problem = _grouped_linear_problem(linear)
        if problem:
            return f"{which}: {problem}"
    if fc1.num_gemms != fc2.num_gemms:
        return f"fc1 has {fc1.num_gemms} GEMMs, fc2 {fc2.num_gemms}"
    if fc1.in_features != fc2.out_features:
        return f"fc1.in_features={fc1.in_features} != fc2.out_features={fc2.out_features}"
    if fc1.out_features == 2 * fc2.in_features:
        gated = True
    elif fc1.out_features == fc2.in_features:
        gated = False
    else:
        return f"fc1.out_features={fc1.out_features} is neither fc2.in_features nor twice it ({fc2.in_features})"
    if bool(fc1.use_bias) != bool(fc2.use_bias):
        return f"bias on one linear only (fc1.use_bias={fc1.use_bias}, fc2.use_bias={fc2.use_bias})"
    own = {id(p) for p in module.parameters()}
    linear_params = {id(p) for lin in (fc1, fc2) for p in lin.parameters()}
    if own != linear_params:
        return "the block holds parameters besides its two GroupedLinear children"
    extra = [c for _, c in children if c is not fc1 and c is not fc2]
    activation = _block_activation(module, extra, gated)
    if isinstance(activation, str):
        return activation
    return _Block(fc1, fc2, activation)


# --------------------------------------------------------------------------- the replacement

class SwappedGroupedMLP(FusedGroupedMLP):
    """``FusedGroupedMLP`` called like the TE block it replaced: ``(x, m_splits[, probs])``."""

    def forward(self, x: torch.Tensor, m_splits, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
        if isinstance(m_splits, (list, tuple)):
            # torch.tensor(..., device="cuda") copies from pageable memory and then waits for the
            # stream (a host sync); a pinned staging copy lets the host go on.
            host = torch.tensor(m_splits, dtype=torch.int64)
            if x.device.type == "cuda":
                host = host.pin_memory()
            m_splits = host.to(x.device, non_blocking=True)
        elif isinstance(m_splits, torch.Tensor) and m_splits.device != x.device:
            m_splits = m_splits.to(x.device, non_blocking=True)
        return super().forward(x, m_splits, probs)


def _stack(linear, kind: str) -> torch.Tensor:
    return torch.stack([getattr(linear, f"{kind}{i}").detach() for i in range(linear.num_gemms)])


def fused_from_block(block: torch.nn.Module, *, backend: str = "auto", recipe: RecipeLike = None) -> SwappedGroupedMLP:
    """A :class:`SwappedGroupedMLP` holding ``block``'s weights (``ValueError`` if not swappable)."""
    found = inspect_block(block)
    if not isinstance(found, _Block):
        raise ValueError(f"block: not a swappable GroupedLinear expert block ({found or 'no two GroupedLinear children'})")
    fc1, fc2 = found.fc1, found.fc2
    weight0 = fc1.weight0
    fused = SwappedGroupedMLP(
        num_experts=fc1.num_gemms, hidden_size=fc1.in_features, ffn_hidden_size=fc2.in_features,
        activation=found.activation.name, bias=bool(fc1.use_bias), recipe=recipe, backend=backend,
        params_dtype=weight0.dtype, device=weight0.device,
        activation_alpha=found.activation.alpha, activation_limit=found.activation.limit,
    )
    with torch.no_grad():
        fused.weight1.copy_(_stack(fc1, "weight"))
        fused.weight2.copy_(_stack(fc2, "weight"))
        if fc1.use_bias:
            fused.bias1.copy_(_stack(fc1, "bias"))
            fused.bias2.copy_(_stack(fc2, "bias"))
    fused.weight1.requires_grad_(weight0.requires_grad)
    fused.weight2.requires_grad_(fc2.weight0.requires_grad)
    if fc1.use_bias:  # frozen biases stay frozen
        fused.bias1.requires_grad_(fc1.bias0.requires_grad)
        fused.bias2.requires_grad_(fc2.bias0.requires_grad)
    return fused


def _copy_back(fused: FusedGroupedMLP, block: torch.nn.Module) -> None:
    found = inspect_block(block)
    with torch.no_grad():
        for i in range(fused.num_experts):
            getattr(found.fc1, f"weight{i}").copy_(fused.weight1[i])
            getattr(found.fc2, f"weight{i}").copy_(fused.weight2[i])
            if fused.bias1 is not None:
                getattr(found.fc1, f"bias{i}").copy_(fused.bias1[i])
                getattr(found.fc2, f"bias{i}").copy_(fused.bias2[i])


# --------------------------------------------------------------------------- walking a model

def _is_megatron_expert_module(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ in _MEGATRON_CLASSES and cls.__module__.startswith("megatron.")


def _candidates(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module, str, torch.nn.Module]]:
    """(qualified name, parent, attribute, child) for children of every module, top-down, not
    descending into blocks already recognised."""
    stack = [("", model)]
    while stack:
        prefix, parent = stack.pop()
        for attr, child in parent.named_children():
            name = f"{prefix}.{attr}" if prefix else attr
            yield name, parent, attr, child
            if inspect_block(child) is None and not _is_megatron_expert_module(child):
                stack.append((name, child))


def swap_experts(model: torch.nn.Module, *, backend: str = "auto", recipe: RecipeLike = None,
                 keep_original: bool = True) -> SwapReport:
    """Replace every expert block in ``model`` (see the module doc for what is recognised) by a
    fused module with the same weights. Returns what was swapped and what was left alone, and why.

    ``recipe``: the quantization recipe of the new modules (``None``: TE's autocast recipe when
    active, else BF16). Megatron blocks take their recipe from Megatron's config / TE's autocast,
    so ``recipe`` must be ``None`` when the model holds them.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if backend not in _MEGATRON_IMPL:
        raise ValueError(f"backend: expected one of {sorted(_MEGATRON_IMPL)}, got {backend!r}")
    if recipe is not None:
        as_recipe(recipe)  # fail early on a bad recipe
    if isinstance(inspect_block(model), _Block):
        raise ValueError("model: the model itself is an expert block; use fused_from_block(model) to get its replacement")
    report = SwapReport()
    has_megatron = False
    for name, parent, attr, child in list(_candidates(model)):
        if _is_megatron_expert_module(child):
            has_megatron = True
            continue
        found = inspect_block(child)
        if found is None:
            continue
        if isinstance(found, str):
            report.skipped.append((name, found))
            continue
        fused = fused_from_block(child, backend=backend, recipe=recipe)
        if keep_original:
            fused.__dict__[_ORIGINAL] = child  # outside the module tree: no duplicate parameters
        setattr(parent, attr, fused)
        report.entries.append(SwapEntry(name, type(child).__name__, f"SwappedGroupedMLP[{backend}]", fused.num_experts))
    if has_megatron:
        if recipe is not None:
            raise ValueError(
                "recipe: Megatron expert modules take their recipe from Megatron's config / TE's autocast; "
                "call swap_experts(..., recipe=None) for models that contain them"
            )
        from megatron_patches.swap import swap_megatron_experts  # only when Megatron blocks exist

        for entry in swap_megatron_experts(model, impl=_MEGATRON_IMPL[backend]).entries:
            report.entries.append(SwapEntry(entry.name, entry.replaced, entry.by, entry.num_local_experts))
    return report


def unswap_experts(model: torch.nn.Module) -> SwapReport:
    """Undo :func:`swap_experts`: original blocks come back with the current fused weights copied in."""
    report = SwapReport()
    has_megatron_swaps = False
    for name, parent, attr, child in list(_candidates(model)):
        if type(child).__name__ == "FusedExpertsMLP":
            has_megatron_swaps = True
        original = child.__dict__.get(_ORIGINAL) if isinstance(child, SwappedGroupedMLP) else None
        if original is None:
            if isinstance(child, SwappedGroupedMLP):
                report.skipped.append((name, "swapped with keep_original=False; nothing to restore"))
            continue
        _copy_back(child, original)
        setattr(parent, attr, original)
        report.entries.append(SwapEntry(name, type(child).__name__, type(original).__name__, child.num_experts))
    if has_megatron_swaps:
        from megatron_patches.swap import unswap_megatron_experts

        for entry in unswap_megatron_experts(model).entries:
            report.entries.append(SwapEntry(entry.name, entry.replaced, entry.by, entry.num_local_experts))
    return report


__all__ = ["SwapEntry", "SwapReport", "SwappedGroupedMLP", "fused_from_block", "inspect_block", "is_grouped_linear",
           "swap_experts", "unswap_experts"]
