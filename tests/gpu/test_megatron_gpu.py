"""Megatron Core integration on a CUDA GPU: fused experts (backend auto) vs SequentialMLP inside a
real MoELayer in BF16, the fused experts without host syncs, and the proxy configs' expert shapes.
Run on the device machine (scripts/device_megatron.sh)."""

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_testing import (  # noqa: E402
    build_experts,
    build_moe_layer,
    copy_expert_weights,
    init_model_parallel,
    make_config,
    moe_layer_step,
)
from moe_reference import rel_err  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    init_model_parallel(ep=1, etp=1)
    # graph-safe RNG states: the graph tests capture Megatron layers (and the eager ones don't mind)
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
    yield


def _gpu_config(impl, **kwargs):
    return make_config(impl, dtype=torch.bfloat16, use_cpu_initialization=False, **kwargs)


@pytest.mark.parametrize("activation,hidden,ffn,experts,topk", [
    ("swiglu", 512, 256, 16, 4),
    ("gpt_oss_swiglu", 384, 384, 8, 4),
])
def test_fused_auto_matches_sequential_in_moe_layer_bf16(activation, hidden, ffn, experts, topk):
    from megatron_patches.experts import FusedExpertsMLP

    torch.manual_seed(torch.randint(1 << 30, (1,)).item())
    kwargs = dict(activation=activation, hidden=hidden, ffn=ffn, experts=experts, topk=topk, num_attention_heads=4)
    layer_s = build_moe_layer(_gpu_config("sequential", **kwargs)).cuda()
    layer_f = build_moe_layer(_gpu_config("fused", **kwargs)).cuda()
    assert isinstance(layer_f.experts, FusedExpertsMLP)
    layer_f.router.load_state_dict(layer_s.router.state_dict())
    copy_expert_weights(layer_s.experts, layer_f.experts)
    x = torch.randn(256, 2, hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    s, f = moe_layer_step(layer_s, x, dy), moe_layer_step(layer_f, x, dy)
    (y_s, dx_s, gw_s), (y_f, dx_f, gw_f) = ((r["y"], r["dx"], r["experts"]) for r in (s, f))
    assert rel_err(y_f, y_s) < 2e-2
    assert rel_err(dx_f, dx_s) < 2e-2
    for key in gw_s:
        if gw_s[key].float().abs().sum() > 0:
            assert rel_err(gw_f[key], gw_s[key]) < 3e-2, key


def test_fused_experts_make_no_host_sync():
    from te_fused_moe.backends import select_backend

    fused = build_experts(_gpu_config("fused", hidden=512, ffn=256, experts=8), 8).cuda()
    chosen = select_backend("auto", torch.device("cuda"), fused.activation, fused.recipe, torch.bfloat16)
    if chosen.name == "reference":
        pytest.skip("backend auto fell back to the reference loop on this GPU (it reads counts on the host)")
    counts = torch.tensor([300, 0, 120, 500, 7, 64, 9, 0], device="cuda")
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(1000, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, _ = fused(x, counts, probs)
        y.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(y.float()).all() and x.grad is not None and probs.grad is not None
    assert fused.linear_fc1.weight.grad is not None and fused.linear_fc2.weight.grad is not None


@pytest.mark.parametrize("config_name", ["gpt_oss_proxy", "qwen3_moe_proxy"])
def test_proxy_expert_shapes_fused_vs_reference(config_name):
    """Each proxy config's expert block, fused (auto) vs fused-reference, same weights and tokens."""
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "configs", f"{config_name}.yaml")) as f:
        model = yaml.safe_load(f)["model"]
    kwargs = dict(activation=model["activation"], hidden=model["hidden_size"], ffn=model["moe_ffn_hidden_size"],
                  experts=model["num_moe_experts"], topk=model["moe_router_topk"])
    auto = build_experts(_gpu_config("fused", **kwargs), kwargs["experts"]).cuda()
    ref = build_experts(_gpu_config("fused-reference", **kwargs), kwargs["experts"]).cuda()
    copy_expert_weights(auto, ref)
    tokens = 2048 * kwargs["topk"]
    counts = torch.bincount(torch.randint(0, kwargs["experts"], (tokens,), device="cuda"), minlength=kwargs["experts"])
    x = torch.randn(tokens, kwargs["hidden"], device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(tokens, device="cuda")
    with torch.no_grad():
        y_auto, _ = auto(x, counts, probs)
        y_ref, _ = ref(x, counts, probs)
    assert rel_err(y_auto, y_ref) < 2e-2


def test_moe_layer_drop_and_pad_step_captures_in_one_graph():
    """A whole MoELayer forward+backward (router, alltoall dispatch in Megatron's fixed-shape
    drop-and-pad mode, fused experts, combine) captured by the launcher's FullIterationGraph, then
    replayed on new tokens: same output and router gradient as the eager step."""
    from megatron_patches.cuda_graph import side_stream

    with side_stream():  # layer, eager steps and capture on one stream (see side_stream)
        _drop_and_pad_graph_step()


def _drop_and_pad_graph_step():
    from megatron_patches.cuda_graph import FullIterationGraph

    torch.manual_seed(torch.randint(1 << 30, (1,)).item())
    config = _gpu_config("fused", hidden=256, ffn=128, experts=8, topk=2, num_attention_heads=4,
                         moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)
    layer = build_moe_layer(config).cuda()

    def step(x, dy):
        layer.zero_grad(set_to_none=True)  # the backward (re)allocates gradients: static inside the graph
        out, _ = layer(x)
        out.backward(dy)
        return out.detach(), layer.router.weight.grad, layer.experts.linear_fc1.weight.grad

    graphed = FullIterationGraph(step, warmup_steps=2)
    shape = (128, 2, 256)
    for _ in range(3):  # 2 eager warm-up calls, then capture + first replay
        graphed(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
                torch.randn(shape, device="cuda", dtype=torch.bfloat16))
    assert graphed.captured
    for _ in range(3):  # new routing every time
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        replayed = [t.clone() for t in graphed(x, dy)]
        eager = step(x, dy)
        for got, want in zip(replayed, eager):
            assert rel_err(got.float(), want.float()) < 1e-2
