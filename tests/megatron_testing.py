"""Helpers for the Megatron Core tests: process groups on CPU (gloo), configs, layer builders.

Used by tests/test_megatron_*.py and the 2-process EP test. Everything runs on CPU with the real
megatron-core; ``torch.distributed`` is initialised with gloo through a file store.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def init_distributed(rank: int = 0, world_size: int = 1, store_file: str = None) -> None:
    """Gloo process group on CPU, NCCL where CUDA is visible (once per process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if store_file is None:
        store_file = os.path.join(tempfile.mkdtemp(prefix="tfm_pg_"), "store")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size)


def init_model_parallel(ep: int = 1, etp: int = 1, rank: int = 0, world_size: int = 1, store_file: str = None) -> None:
    """(Re)initialise Megatron's parallel state with the given expert parallel sizes."""
    from megatron.core import parallel_state

    init_distributed(rank, world_size, store_file)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )


ACTIVATIONS = {
    # name: (activation_func, gated_linear_unit, glu_linear_offset, activation_func_clamp_value)
    "swiglu": (F.silu, True, 0.0, None),
    "geglu": (F.gelu, True, 0.0, None),
    "gpt_oss_swiglu": ("quick_gelu", True, 1.0, 7.0),
    "srelu": ("squared_relu", False, 0.0, None),
}


def activation_kwargs(name: str) -> dict:
    func, gated, offset, clamp = ACTIVATIONS[name]
    if func == "quick_gelu":
        from megatron.core.activations import quick_gelu as func
    elif func == "squared_relu":
        from megatron.core.activations import squared_relu as func
    return dict(activation_func=func, gated_linear_unit=gated, glu_linear_offset=offset,
                activation_func_clamp_value=clamp)


def make_config(impl: str, *, activation: str = "swiglu", hidden: int = 16, ffn: int = 24, experts: int = 4,
                topk: int = 2, bias: bool = False, dispatcher: str = "alltoall", ep: int = 1, etp: int = 1,
                dtype=torch.float32, **extra):
    """A small MoE config with ``moe_grouped_gemm_impl=impl`` (our dataclass subclass)."""
    from megatron_patches import FusedMoETransformerConfig

    kwargs = dict(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, num_moe_experts=experts,
        moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn, add_bias_linear=bias, moe_router_topk=topk,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=impl != "sequential",
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, moe_aux_loss_coeff=0.0,
        bias_dropout_fusion=False, moe_grouped_gemm_impl=impl,
    )
    kwargs.update(activation_kwargs(activation))
    kwargs.update(extra)
    return FusedMoETransformerConfig(**kwargs)


def build_experts(config, num_local_experts: int):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_patches.spec import build_experts as build, experts_spec

    return build(experts_spec(config, use_te=False), num_local_experts, config, get_default_pg_collection())


def build_moe_layer(config):
    """A full ``MoELayer`` (router, dispatcher, experts from the option) on local linears."""
    from megatron_patches.spec import get_moe_layer_spec

    spec = get_moe_layer_spec(config, use_te=False)
    if isinstance(spec, functools.partial):
        return spec(config=config)
    from megatron.core.transformer.spec_utils import build_module

    return build_module(spec, config=config)


def copy_expert_weights(src, dst) -> None:
    """Copy expert weights between any two of SequentialMLP / FusedExpertsMLP (via TE-style keys)."""
    from megatron_patches.swap import _expert_tensors

    with torch.no_grad():
        if hasattr(dst, "local_experts"):
            targets = {(i, lin, kind): t for i, lin, kind, t in _expert_tensors(dst)}
        else:
            targets = {(i, lin, kind): getattr(getattr(dst, lin), kind)[i]
                       for i in range(dst.num_local_experts) for lin in ("linear_fc1", "linear_fc2")
                       for kind in ("weight", "bias") if getattr(getattr(dst, lin), kind) is not None}
        if hasattr(src, "local_experts"):
            sources = {(i, lin, kind): t for i, lin, kind, t in _expert_tensors(src)}
        else:
            sources = {k: getattr(getattr(src, k[1]), k[2])[k[0]] for k in targets}
        assert sources.keys() == targets.keys(), (sorted(sources), sorted(targets))
        for k, t in targets.items():
            t.copy_(sources[k])


def expert_grads(module) -> dict:
    """Per-expert gradients keyed like the TE state dict: ('linear_fc1', 'weight', i) -> grad."""
    out = {}
    if hasattr(module, "local_experts"):
        for i, expert in enumerate(module.local_experts):
            for lin in ("linear_fc1", "linear_fc2"):
                for kind in ("weight", "bias"):
                    p = getattr(getattr(expert, lin), kind, None)
                    if isinstance(p, torch.Tensor):
                        out[(lin, kind, i)] = p.grad
    else:
        for lin in ("linear_fc1", "linear_fc2"):
            for kind in ("weight", "bias"):
                p = getattr(getattr(module, lin), kind)
                if p is not None:
                    for i in range(module.num_local_experts):
                        out[(lin, kind, i)] = p.grad[i]
    return out


def moe_layer_step(layer, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """One forward+backward of a ``MoELayer`` on a copy of ``x``: output, input gradient, router
    weight gradient and the experts' parameter gradients (for comparing two implementations)."""
    xi = x.clone().requires_grad_(True)
    out, _ = layer(xi)
    out.backward(dy)
    router_grad = layer.router.weight.grad
    return {"y": out.detach(), "dx": xi.grad, "router": None if router_grad is None else router_grad.clone(),
            "experts": expert_grads(layer.experts)}
