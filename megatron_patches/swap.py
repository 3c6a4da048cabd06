"""Swap Megatron expert blocks in a built model for ``FusedExpertsMLP`` (same weights) and back.

Use it on a model that was built without :func:`megatron_patches.install`, e.g. to compare
implementations on one set of weights. Swap before wrapping the model in DDP and before
building the optimizer: the swapped module has new parameter tensors.

Handled: ``SequentialMLP``, ``TEGroupedMLP`` and, where megatron-core still has it (0.16), the
legacy ``GroupedMLP``, whose weights are two merged tensors that its forward reads as
``weight1.view(E, H, N1)`` and ``weight2.view(E, F, H)`` (each expert's matrices transposed
relative to ours); its per-expert tensors here are views of those, so unswapping writes into them.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from typing import Iterator, List, Tuple

import torch

from .config import FIELD, is_fused_impl

_ORIGINAL = "_te_fused_moe_swapped_from"


@dataclasses.dataclass
class SwapEntry:
    name: str
    replaced: str
    by: str
    num_local_experts: int


@dataclasses.dataclass
class SwapReport:
    entries: List[SwapEntry]

    def __len__(self) -> int:
        return len(self.entries)

    def __str__(self) -> str:
        if not self.entries:
            return "no expert blocks swapped"
        lines = [f"{e.name}: {e.replaced} -> {e.by} ({e.num_local_experts} local experts)" for e in self.entries]
        return "\n".join(lines)


def _swappable_classes() -> Tuple[type, ...]:
    from megatron.core.transformer.moe import experts

    names = ("SequentialMLP", "TEGroupedMLP", "GroupedMLP")
    return tuple(getattr(experts, name) for name in names if hasattr(experts, name))


def _is_legacy_grouped(module) -> bool:
    return hasattr(module, "weight1") and hasattr(module, "weight2") and not hasattr(module, "linear_fc1")


def _legacy_expert_tensors(module) -> Iterator[Tuple[int, str, str, torch.Tensor]]:
    """GroupedMLP's experts as views shaped like ours: fc1 ``[N1, H]``, fc2 ``[H, F]``."""
    experts, hidden = module.num_local_experts, module.config.hidden_size
    fc1 = module.weight1.view(experts, hidden, -1)
    fc2 = module.weight2.view(experts, -1, hidden)
    for i in range(experts):
        yield i, "linear_fc1", "weight", fc1[i].t()
        yield i, "linear_fc2", "weight", fc2[i].t()


def _expert_tensors(module) -> Iterator[Tuple[int, str, str, torch.Tensor]]:
    """(expert index, 'linear_fc1'/'linear_fc2', 'weight'/'bias', tensor) of a Megatron expert block."""
    if _is_legacy_grouped(module):
        yield from _legacy_expert_tensors(module)
        return
    for i in range(module.num_local_experts):
        for linear in ("linear_fc1", "linear_fc2"):
            for kind in ("weight", "bias"):
                if hasattr(module, "local_experts"):  # SequentialMLP
                    tensor = getattr(getattr(module.local_experts[i], linear), kind, None)
                else:  # TEGroupedMLP
                    tensor = getattr(getattr(module, linear), f"{kind}{i}", None)
                if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
                    yield i, linear, kind, tensor


def _pg_collection(module):
    groups = types.SimpleNamespace(ep=module.ep_group, expt_tp=module.tp_group, expt_dp=getattr(module, "dp_group", None))
    if groups.expt_dp is None:
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        groups.expt_dp = get_default_pg_collection().expt_dp
    return groups


def _fused_from(module, impl: str):
    from .experts import FusedExpertsMLP

    config = copy.copy(module.config)
    setattr(config, FIELD, impl)
    config.moe_grouped_gemm = True
    if getattr(config, "moe_use_legacy_grouped_gemm", False):
        config.moe_use_legacy_grouped_gemm = False  # the flag that selected GroupedMLP
    config.perform_initialization = False
    if getattr(config, "moe_ffn_hidden_size", None) is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    fused = FusedExpertsMLP(module.num_local_experts, config, pg_collection=_pg_collection(module))
    first = next(iter(module.parameters()))
    fused.to(device=first.device, dtype=first.dtype)
    with torch.no_grad():
        for i, linear, kind, tensor in _expert_tensors(module):
            target = getattr(getattr(fused, linear), kind)
            if target is None or tuple(target[i].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"swap: {linear}.{kind} of expert {i} has shape {tuple(tensor.shape)}, expected "
                    f"{None if target is None else tuple(target[i].shape)} (config mismatch?)"
                )
            target[i].copy_(tensor)
    return fused


def _named_children_of(model):
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            yield parent_name, parent, child_name, child


def swap_megatron_experts(model: torch.nn.Module, impl: str = "fused") -> SwapReport:
    """Replace every ``SequentialMLP``/``TEGroupedMLP``/``GroupedMLP`` in ``model`` by a ``FusedExpertsMLP`` with the
    same weights (``impl`` picks the backend: ``fused``, ``fused-triton``, ...)."""
    if not is_fused_impl(impl):
        raise ValueError(f"impl: expected one of 'fused', 'fused-triton', 'fused-cudnn', 'fused-reference', got {impl!r}")
    classes = _swappable_classes()
    entries = []
    for parent_name, parent, child_name, child in list(_named_children_of(model)):
        if not isinstance(child, classes):
            continue
        fused = _fused_from(child, impl)
        fused.__dict__[_ORIGINAL] = child  # kept out of the module tree (no duplicate parameters)
        setattr(parent, child_name, fused)
        name = f"{parent_name}.{child_name}" if parent_name else child_name
        entries.append(SwapEntry(name, type(child).__name__, f"FusedExpertsMLP[{impl}]", child.num_local_experts))
    return SwapReport(entries)


def unswap_megatron_experts(model: torch.nn.Module) -> SwapReport:
    """Put the original expert blocks back, with the (possibly trained) fused weights copied in."""
    entries = []
    for parent_name, parent, child_name, child in list(_named_children_of(model)):
        original = child.__dict__.get(_ORIGINAL)
        if original is None:
            continue
        with torch.no_grad():
            for i, linear, kind, tensor in _expert_tensors(original):
                tensor.copy_(getattr(getattr(child, linear), kind)[i])
        setattr(parent, child_name, original)
        name = f"{parent_name}.{child_name}" if parent_name else child_name
        entries.append(SwapEntry(name, f"FusedExpertsMLP[{child.impl}]", type(original).__name__, original.num_local_experts))
    return SwapReport(entries)
