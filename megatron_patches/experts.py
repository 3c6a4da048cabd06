"""``FusedExpertsMLP``: Megatron's expert block computed by ``te_fused_moe.fused_moe_mlp``.

Drop-in for ``TEGroupedMLP`` inside a ``MoELayer``:

* built as ``FusedExpertsMLP(num_local_experts, config, submodules=None, pg_collection=..., name=...)``
  (megatron-core 0.16 passes a ``ModuleSpec``'s ``submodules``; 0.19 calls the builder with
  ``pg_collection`` and ``name`` only; both work);
* ``forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs) -> (output, None)``;
  ``tokens_per_expert`` stays on the GPU (it is moved there without a host sync when a dispatcher
  hands a CPU tensor or a list), so the experts never make the host wait;
* parameters are stacked per projection: ``linear_fc1.weight [E, 2F/etp, H]`` (gate rows, then up
  rows, per expert) and ``linear_fc2.weight [E, H, F/etp]`` (+ biases ``[E, N]``). The *state
  dict* unstacks them into TEGroupedMLP's per-expert keys ``linear_fc1.weight0..E-1`` (and
  ``_extra_state``), and the *sharded* state dict produces the same checkpoint tensors as
  TEGroupedMLP/SequentialMLP (``<prefix>experts.linear_fc1.weight`` sharded over global experts
  and ETP, GLU halves split), so checkpoints move between ``te``, ``sequential`` and ``fused``.

Expert tensor parallelism: each ETP rank holds ``F/etp`` of every expert and returns a partial
sum of the output, which the token dispatcher reduces, exactly as with TEGroupedMLP.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional, Tuple

import torch
from torch.nn.parameter import Parameter

from megatron.core.transformer.module import MegatronModule

from te_fused_moe import fused_moe_mlp

from .activation import megatron_activation
from .checkpoint import expert_sharded_state_dict
from .config import (
    fused_backend,
    get_moe_grouped_gemm_impl,
    is_fused_impl,
    validate_fused_config,
    validate_moe_grouped_gemm_impl,
)
from .recipe import recipe_from_config

DEFAULT_IMPL = "fused"


def group_size(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


def group_rank(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group)


class StackedExpertLinear(torch.nn.Module):
    """One projection of all local experts: ``weight [E, out, in]`` and optional ``bias [E, out]``.

    Saved and loaded with TE ``GroupedLinear``'s per-expert keys (``weight{i}``, ``bias{i}``,
    ``_extra_state``); loading also accepts the stacked ``weight``/``bias`` that a dist-checkpoint
    load returns for the sharded state dict's factories.
    """

    def __init__(self, num_experts: int, out_features: int, in_features: int, bias: bool, dtype, device):
        super().__init__()
        self.num_experts = num_experts
        self.weight = Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype, device=device))
        if bias:
            self.bias = Parameter(torch.zeros(num_experts, out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def _tensors(self):
        return (("weight", self.weight), ("bias", self.bias))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, param in self._tensors():
            if param is None:
                continue
            value = param if keep_vars else param.detach()
            for i in range(self.num_experts):
                destination[f"{prefix}{name}{i}"] = value[i]
        # TE keeps FP8 metadata here; our recipes are stateless, so it is empty, but the key is
        # present so that strict loads work in both directions.
        destination[f"{prefix}_extra_state"] = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        consumed = set()
        for name, param in self._tensors():
            if param is None:
                continue
            stacked_key = f"{prefix}{name}"
            if stacked_key in state_dict:
                self._copy_in(param, state_dict[stacked_key], stacked_key, error_msgs)
                consumed.add(stacked_key)
                continue
            for i in range(self.num_experts):
                key = f"{prefix}{name}{i}"
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                self._copy_in(param[i], state_dict[key], key, error_msgs)
                consumed.add(key)
        for key in state_dict:
            if not key.startswith(prefix) or key in consumed:
                continue
            rest = key[len(prefix):]
            if rest.startswith("_extra_state"):
                continue  # TE's FP8 metadata (plain or split per expert by the sharded state dict)
            if "." not in rest and strict:
                unexpected_keys.append(key)

    @staticmethod
    def _copy_in(target: torch.Tensor, value, key: str, error_msgs) -> None:
        if not isinstance(value, torch.Tensor):
            error_msgs.append(f"{key}: expected a tensor, got {type(value).__name__}")
            return
        if tuple(value.shape) != tuple(target.shape):
            error_msgs.append(f"{key}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
            return
        with torch.no_grad():
            target.copy_(value)


def _mark_expert_parameter(param: Parameter, *, use_expert_groups: bool, tp_dim: Optional[int]) -> None:
    """Attributes Megatron's DDP, optimizer and grad-norm code read on expert parameters."""
    param.allreduce = not use_expert_groups  # False: gradients reduced over the expert-DP group
    if tp_dim is not None:
        param.tensor_model_parallel = True
        param.partition_dim = tp_dim
        param.partition_stride = 1


def _expert_init_context(device: torch.device):
    """Megatron initialises expert weights under its expert-parallel RNG stream on the GPU."""
    if device.type != "cuda":
        return nullcontext()
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        tracker = get_cuda_rng_tracker()
        if tracker.is_initialized():
            return tracker.fork(get_expert_parallel_rng_tracker_name())
    except (ImportError, AttributeError, Exception):  # noqa: BLE001 - init without the stream is still valid
        pass
    return nullcontext()


class FusedExpertsMLP(MegatronModule):
    """Expert MLP of a ``MoELayer`` on top of the fused op (see the module docstring)."""

    def __init__(
        self,
        num_local_experts: int,
        config,
        submodules: Any = None,
        pg_collection: Any = None,
        name: Optional[str] = None,
    ):
        super().__init__(config=config)
        impl = get_moe_grouped_gemm_impl(config) or DEFAULT_IMPL
        if not is_fused_impl(impl):
            raise ValueError(
                f"moe_grouped_gemm_impl={impl!r}: FusedExpertsMLP runs the 'fused*' implementations only"
            )
        validate_moe_grouped_gemm_impl(config)
        if get_moe_grouped_gemm_impl(config) is None:
            validate_fused_config(config, impl)  # built from a spec directly: the checks above skipped these
        self.impl = impl
        self.backend = fused_backend(impl)
        self.activation = megatron_activation(config)
        self.recipe = recipe_from_config(config)
        if config.moe_ffn_hidden_size is None:
            raise ValueError("moe_ffn_hidden_size: expected an int (the expert FFN width), got None")
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()

        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        tp_size = group_size(self.tp_group)
        ffn = config.moe_ffn_hidden_size
        if ffn % tp_size:
            raise ValueError(
                f"moe_ffn_hidden_size={ffn} must be divisible by expert_tensor_parallel_size={tp_size}"
            )
        ffn_local = ffn // tp_size
        fc1_out = 2 * ffn_local if self.activation.gated else ffn_local
        hidden = config.hidden_size
        use_cpu = getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available()
        device = torch.device("cpu") if use_cpu else torch.device("cuda", torch.cuda.current_device())
        bias = bool(config.add_bias_linear)

        self.linear_fc1 = StackedExpertLinear(num_local_experts, fc1_out, hidden, bias, config.params_dtype, device)
        self.linear_fc2 = StackedExpertLinear(num_local_experts, hidden, ffn_local, bias, config.params_dtype, device)

        if getattr(config, "perform_initialization", True):
            with _expert_init_context(device), torch.no_grad():
                for i in range(num_local_experts):
                    config.init_method(self.linear_fc1.weight[i])
                    config.output_layer_init_method(self.linear_fc2.weight[i])

        ep_size = group_size(self.ep_group)
        use_expert_groups = ep_size > 1 or tp_size != getattr(config, "tensor_model_parallel_size", 1)
        _mark_expert_parameter(self.linear_fc1.weight, use_expert_groups=use_expert_groups, tp_dim=1)
        _mark_expert_parameter(self.linear_fc2.weight, use_expert_groups=use_expert_groups, tp_dim=2)
        if bias:
            _mark_expert_parameter(self.linear_fc1.bias, use_expert_groups=use_expert_groups, tp_dim=1)
            _mark_expert_parameter(self.linear_fc2.bias, use_expert_groups=use_expert_groups, tp_dim=None)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert,
        permuted_probs: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, None]:
        x = permuted_local_hidden_states
        if x.dim() != 2:
            x = x.reshape(-1, x.shape[-1])
        counts = counts_on_device(tokens_per_expert, x.device)
        probs = None if permuted_probs is None else permuted_probs.reshape(-1)
        if probs is not None and self.config.moe_apply_probs_on_input:
            # Same as TEGroupedMLP: scale the input rows, then run the experts without probs.
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = None
        if probs is not None:
            probs = probs.contiguous()
        fc2_bias = self.linear_fc2.bias
        y = fused_moe_mlp(
            x.contiguous(),
            counts,
            self.linear_fc1.weight,
            self.linear_fc2.weight,
            activation=self.activation,
            recipe=self.recipe,
            b1=self.linear_fc1.bias,
            b2=None,
            probs=probs,
            backend=self.backend,
            deterministic=bool(getattr(self.config, "deterministic_mode", False)),
        )
        if fc2_bias is not None:
            # TEGroupedMLP / SequentialMLP add the fc2 bias scaled by the router prob.
            y = add_expert_bias(y, fc2_bias, counts, probs)
        return y, None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the regular backward (no delayed wgrad)."""

    # ------------------------------------------------------------------ checkpoints
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        return expert_sharded_state_dict(self, prefix, sharded_offsets, metadata)


def counts_on_device(tokens_per_expert, device: torch.device) -> torch.Tensor:
    """``tokens_per_expert`` as an int tensor on ``device``.

    A tensor already on ``device`` is used as is (the sync-free path). Dispatchers that already
    synced the counts hand them on the host (a CPU tensor or a list): reading host memory makes
    nothing wait for the GPU, and the device copy for the same values is reused
    (:data:`_HOST_COUNTS_ON_DEVICE`), so a step whose host counts do not change, such as Megatron's
    drop-and-pad dispatchers with their fixed capacity, issues no host-to-device copy and can be
    captured in a CUDA graph.
    """
    if isinstance(tokens_per_expert, torch.Tensor):
        counts = tokens_per_expert
        if counts.dtype not in (torch.int32, torch.int64):
            counts = counts.to(torch.int64)
        if counts.device == device:
            return counts
        if counts.device.type != "cpu":
            return counts.to(device, non_blocking=True)
        values = tuple(counts.tolist())  # host memory: no device sync
    elif isinstance(tokens_per_expert, (list, tuple)):
        values = tuple(int(c) for c in tokens_per_expert)
    else:
        raise TypeError(
            f"tokens_per_expert: expected a tensor or a list of ints, got {type(tokens_per_expert).__name__}"
        )
    key = (device, values)
    capturing = _stream_is_capturing(device)
    cached = _HOST_COUNTS_ON_DEVICE.get(key)
    if cached is None:
        if capturing:
            raise RuntimeError(
                f"tokens_per_expert: host counts {list(values)} were first seen while a CUDA graph was being "
                "captured; their host-to-device copy cannot be captured. Run an eager step with the same "
                "counts (e.g. drop-and-pad's fixed capacity) before capturing"
            )
        cached = torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
        if len(_HOST_COUNTS_ON_DEVICE) >= _HOST_COUNTS_CACHE_SIZE:
            # oldest first, never one a captured graph reads (its memory would be reused under it)
            evictable = next((k for k in _HOST_COUNTS_ON_DEVICE if k not in _HOST_COUNTS_CAPTURED), None)
            if evictable is not None:
                _HOST_COUNTS_ON_DEVICE.pop(evictable)
        _HOST_COUNTS_ON_DEVICE[key] = cached
    if capturing:
        _HOST_COUNTS_CAPTURED.add(key)
    elif device.type == "cuda":
        # The copy may be read on another stream than the one that allocated it; without this,
        # evicting it could hand its memory to a new tensor while that stream still reads it.
        cached.record_stream(torch.cuda.current_stream(device))
    return cached


def _stream_is_capturing(device: torch.device) -> bool:
    """True while the current CUDA stream records a graph (a host-side query, no sync)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# (device, counts) -> the device tensor made for them; read-only for every user.
_HOST_COUNTS_ON_DEVICE: dict = {}
_HOST_COUNTS_CACHE_SIZE = 16
# Keys whose tensor some CUDA graph captured: kept for the life of the process.
_HOST_COUNTS_CAPTURED: set = set()


def add_expert_bias(y: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor,
                    probs: Optional[torch.Tensor]) -> torch.Tensor:
    """``y[r] += bias[expert(r)] * probs[r]`` without reading ``counts`` on the host.

    Row ``r`` belongs to the first expert whose cumulative count exceeds ``r``; rows past the
    routed total (padding) get no bias.
    """
    rows = y.shape[0]
    num_experts = bias.shape[0]
    ends = torch.cumsum(counts.to(torch.int64), dim=0)
    row_ids = torch.arange(rows, device=y.device, dtype=torch.int64)
    expert = torch.searchsorted(ends, row_ids, right=True)
    routed = (expert < num_experts).unsqueeze(-1)
    row_bias = bias[expert.clamp(max=num_experts - 1)] * routed
    if probs is not None:
        row_bias = row_bias * probs.unsqueeze(-1)
    return (y + row_bias).to(y.dtype)
