"""Expert parallelism on CPU (issue 8's CPU part): a MoELayer with fused-reference experts sharded
over 2 gloo processes gives the same outputs and gradients as the unsharded layer on the same
tokens.

Scenarios (2 processes, one spawn):
* EP=2, all-to-all dispatcher: experts 0-1 on rank 0, 2-3 on rank 1;
* EP=2, all-gather dispatcher;
* ETP=2 (expert tensor parallel), all-to-all: each rank holds half of every expert's FFN width,
  and the dispatcher reduces the partial outputs.
Each rank keeps its own tokens; the reference is an EP=1/ETP=1 layer holding all experts with the
same global weights, run by the same process on the same tokens. Expert weight gradients of the
reference are summed over both ranks (every rank's tokens reach every expert) and sliced to the
rank's shard. Each scenario also checks that the sharded state dict (global expert offsets, ETP
fragments, GLU halves, replica ids) equals SequentialMLP's on every rank.
"""

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")

HIDDEN, FFN, EXPERTS = 16, 24, 4
SCENARIOS = (("ep2-alltoall", 2, 1, "alltoall"), ("ep2-allgather", 2, 1, "allgather"), ("etp2-alltoall", 1, 2, "alltoall"))


def _global_weights():
    g = torch.Generator().manual_seed(1234)
    return {
        "w1": torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g) / HIDDEN ** 0.5,
        "w2": torch.randn(EXPERTS, HIDDEN, FFN, generator=g) / FFN ** 0.5,
        "router": torch.randn(EXPERTS, HIDDEN, generator=g),
    }


def _shard(weights, rank, ep, etp):
    """This rank's slice of the global expert weights: experts by EP, FFN width by ETP."""
    local = EXPERTS // ep
    experts = slice(rank * local, (rank + 1) * local) if ep > 1 else slice(0, EXPERTS)
    w1, w2 = weights["w1"][experts], weights["w2"][experts]
    if etp > 1:
        part = FFN // etp
        cols = slice(rank * part, (rank + 1) * part)
        gate, up = w1[:, :FFN], w1[:, FFN:]
        w1 = torch.cat([gate[:, cols], up[:, cols]], dim=1)
        w2 = w2[:, :, cols]
    return w1.contiguous(), w2.contiguous()


def _run_layer(config_kwargs, rank, ep, etp, dispatcher, x, dy):
    from megatron_testing import build_moe_layer, make_config

    layer = build_moe_layer(make_config("fused-reference", dispatcher=dispatcher, ep=ep, etp=etp, **config_kwargs))
    weights = _global_weights()
    w1, w2 = _shard(weights, rank, ep, etp)
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        layer.experts.linear_fc1.weight.copy_(w1)
        layer.experts.linear_fc2.weight.copy_(w2)
    xi = x.clone().requires_grad_(True)
    out, _ = layer(xi)
    out.backward(dy)
    return dict(y=out.detach(), dx=xi.grad, drouter=layer.router.weight.grad,
                dw1=layer.experts.linear_fc1.weight.grad, dw2=layer.experts.linear_fc2.weight.grad)


def _sharded_layouts_match(ep, etp) -> bool:
    """Our sharded state dict equals SequentialMLP's on this rank (keys, offsets, fragmentations)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from megatron_testing import build_experts, make_config

    def layout(module):
        sharded = module.sharded_state_dict("decoder.layers.0.mlp.experts.", ((0, 0, 1),))
        apply_factories(sharded)
        return sorted((type(v).__name__, v.key, tuple(getattr(v, "global_shape", ())),
                       tuple(getattr(v, "global_offset", ())), tuple(getattr(v, "axis_fragmentations", ()) or ()),
                       v.replica_id) for v in nested_values(sharded))

    local = EXPERTS // ep
    for bias in (False, True) if etp == 1 else (False,):  # Megatron allows expert biases only without ETP
        kwargs = dict(ep=ep, etp=etp, ffn=FFN, hidden=HIDDEN, bias=bias)
        fused = build_experts(make_config("fused-reference", **kwargs), local)
        sequential = build_experts(make_config("sequential", **kwargs), local)
        if layout(fused) != layout(sequential):
            return False
    return True


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _worker(rank, world_size, store_file, out_dir):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_patches.cpu_compat import cpu_cuda_shim
    from megatron_testing import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world_size, store_file)
    results = {}
    with cpu_cuda_shim():
        for name, ep, etp, dispatcher in SCENARIOS:
            g = torch.Generator().manual_seed(100 + rank)
            x = torch.randn(5, 2, HIDDEN, generator=g)  # this rank's own tokens
            dy = torch.randn(5, 2, HIDDEN, generator=g)

            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
            sharded = _run_layer({}, rank, ep, etp, dispatcher, x, dy)

            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(expert_model_parallel_size=1, expert_tensor_parallel_size=1)
            full = _run_layer({}, rank, 1, 1, dispatcher, x, dy)
            for key in ("dw1", "dw2"):  # every rank's tokens contribute to every expert's gradient
                dist.all_reduce(full[key])
            ref_w1, ref_w2 = _shard({"w1": full["dw1"], "w2": full["dw2"], "router": None}, rank, ep, etp)
            results[name] = {
                "y": _rel(sharded["y"], full["y"]),
                "dx": _rel(sharded["dx"], full["dx"]),
                "drouter": _rel(sharded["drouter"], full["drouter"]),
                "dw1": _rel(sharded["dw1"], ref_w1),
                "dw2": _rel(sharded["dw2"], ref_w2),
                "tokens_routed_here": int(sharded["y"].numel()),
            }
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
            results[name]["checkpoint_layout_matches_sequential"] = _sharded_layouts_match(ep, etp)
    parallel_state.destroy_model_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def test_expert_parallel_matches_single_rank(tmp_path):
    import torch.multiprocessing as mp

    store = str(tmp_path / "store")
    mp.spawn(_worker, args=(2, store, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            results = json.load(f)
        assert set(results) == {name for name, *_ in SCENARIOS}
        for name, errors in results.items():
            for key in ("y", "dx", "drouter", "dw1", "dw2"):
                assert errors[key] < 1e-5, (rank, name, key, errors)
            assert errors["checkpoint_layout_matches_sequential"] is True, (rank, name)
