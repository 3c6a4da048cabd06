"""Sharded state dict of ``FusedExpertsMLP``: TEGroupedMLP's checkpoint tensors from stacked params.

What lands in a checkpoint is identical to TEGroupedMLP and SequentialMLP (megatron-core 0.16 and
0.19): for every local expert ``i`` with global index ``g = ep_rank * E_local + i``

* ``<prefix>experts.linear_fc1.weight``: global shape ``[E_global, N1, H]``, this rank's piece at
  expert ``g``, rows sharded over expert-TP; with a gated activation the local ``[gate; up]``
  rows are saved as two pieces (gate at fragment ``etp_rank`` of ``2*etp``, up at
  ``etp + etp_rank``), so the global tensor is ``[gate(F); up(F)]`` whatever the ETP size;
* ``<prefix>experts.linear_fc2.weight``: ``[E_global, H, F]``, columns sharded over expert-TP;
* biases likewise (fc1 bias as fc1's rows, fc2 bias replicated over expert-TP);
* ``<prefix>experts.linear_fc{1,2}._extra_state``: an empty object per expert;
* ``singleton_local_shards`` metadata: one key per expert (``experts.<g>.linear_fc1.weight``,
  GLU halves as ``..._w``/``..._v``), as Megatron does.
Replica ids are ``(0, 0 or etp_rank, expert_dp_rank)`` as in those classes.

Each stacked parameter is wrapped in ONE ``ShardedTensorFactory`` whose ``data`` is the parameter
itself: Megatron's optimizers match optimizer state to model tensors by parameter identity, so
this keeps optimizer checkpoints working too (the factory builds the per-expert pieces of
``exp_avg`` etc. the same way). The dictionary keys of our sharded state dict therefore name the
stacked parameters (``<prefix>linear_fc1.weight``); the checkpoint keys inside are TE's.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_object_for_checkpoint


class _ExpertLayout:
    """Where this rank's experts and ETP slice sit in the global checkpoint tensors."""

    def __init__(self, module, prefix: str, sharded_offsets: tuple, singleton: bool):
        from .experts import group_rank, group_size

        self.prefix = prefix
        self.sharded_offsets = tuple(sharded_offsets)
        self.singleton = singleton
        self.num_local = module.num_local_experts
        self.num_global = group_size(module.ep_group) * self.num_local
        self.expert_offset = group_rank(module.ep_group) * self.num_local
        self.tp_rank = group_rank(module.tp_group)
        self.tp_size = group_size(module.tp_group)
        self.edp_rank = group_rank(module.dp_group)

    def expert_key_and_offsets(self, key: str, suffix: str, local_idx: int):
        """Checkpoint key, leading offsets and number of prepended axes for one local expert."""
        global_idx = self.expert_offset + local_idx
        if self.singleton:
            head = key[: len(key) - len(suffix)]
            return f"{head}{global_idx}.{suffix}", self.sharded_offsets, len(self.sharded_offsets)
        ep_axis = len(self.sharded_offsets)
        offsets = (*self.sharded_offsets, (ep_axis, global_idx, self.num_global))
        return key, offsets, ep_axis + 1


def _stacked_factory(layout: _ExpertLayout, key: str, suffix: str, param: torch.Tensor, tp_axis: Optional[int],
                     glu: bool, replica_id) -> ShardedTensorFactory:
    """A factory turning a stacked ``[E, ...]`` tensor into per-expert ShardedTensors and back."""

    @torch.no_grad()
    def build(key: str, data: torch.Tensor, replica_id, flattened_range):
        if flattened_range is not None:
            raise NotImplementedError(
                "FusedExpertsMLP checkpoints: flattened_range (the distributed optimizer's "
                "'fully_sharded_model_space' format) is not supported; use the 'dp_reshardable' or "
                "'fully_reshardable' format"
            )
        pieces: List[ShardedTensor] = []
        for i in range(layout.num_local):
            expert_key, offsets, prepend = layout.expert_key_and_offsets(key, suffix, i)
            tensor = data[i]
            if tp_axis is None:
                pieces.append(ShardedTensor.from_rank_offsets(
                    expert_key, tensor, *offsets, replica_id=replica_id, prepend_axis_num=prepend))
                continue
            if not glu:
                tp_offset = (prepend + tp_axis, layout.tp_rank, layout.tp_size)
                pieces.append(ShardedTensor.from_rank_offsets(
                    expert_key, tensor, *offsets, tp_offset, replica_id=replica_id, prepend_axis_num=prepend))
                continue
            gate, up = torch.chunk(tensor, 2, dim=tp_axis)
            if layout.singleton:
                halves = ((f"{expert_key}_w", gate, layout.tp_rank, layout.tp_size),
                          (f"{expert_key}_v", up, layout.tp_rank, layout.tp_size))
            else:
                halves = ((expert_key, gate, layout.tp_rank, 2 * layout.tp_size),
                          (expert_key, up, layout.tp_size + layout.tp_rank, 2 * layout.tp_size))
            for half_key, half, rank_offset, fragments in halves:
                pieces.append(ShardedTensor.from_rank_offsets(
                    half_key, half, *offsets, (prepend + tp_axis, rank_offset, fragments),
                    replica_id=replica_id, prepend_axis_num=prepend))
        return pieces

    def merge(loaded: List[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            if glu:
                loaded = [torch.cat(loaded[j:j + 2], dim=tp_axis) for j in range(0, len(loaded), 2)]
            return torch.stack(list(loaded))

    return ShardedTensorFactory(key, param, build, merge, replica_id)


def expert_sharded_state_dict(module, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
    """Sharded state dict of a ``FusedExpertsMLP`` (see the module docstring)."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = bool(metadata.get("singleton_local_shards", False))
    layout = _ExpertLayout(module, prefix, sharded_offsets, singleton)
    gated = module.activation.gated
    tp_sharded_replica = (0, 0, layout.edp_rank)
    replicated_over_tp = (0, layout.tp_rank, layout.edp_rank)

    out = {}
    for name, linear, weight_tp_axis in (("linear_fc1", module.linear_fc1, 0), ("linear_fc2", module.linear_fc2, 1)):
        glu = gated and name == "linear_fc1"
        base = f"{prefix}experts.{name}."
        out[f"{prefix}{name}.weight"] = _stacked_factory(
            layout, f"{base}weight", f"{name}.weight", linear.weight, weight_tp_axis, glu, tp_sharded_replica)
        if linear.bias is not None:
            bias_tp_axis = 0 if name == "linear_fc1" else None
            replica = tp_sharded_replica if bias_tp_axis is not None else replicated_over_tp
            out[f"{prefix}{name}.bias"] = _stacked_factory(
                layout, f"{base}bias", f"{name}.bias", linear.bias, bias_tp_axis, glu, replica)
        for i in range(layout.num_local):
            key, offsets, _ = layout.expert_key_and_offsets(f"{base}_extra_state", f"{name}._extra_state", i)
            out[f"{prefix}{name}._extra_state{'' if i == 0 else i}"] = make_sharded_object_for_checkpoint(
                None, key, offsets, replica_id=replicated_over_tp)
    return out
