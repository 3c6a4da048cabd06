"""backend="cudnn" on a Blackwell GPU (compute capability >= 10) against the FP64 loop and the
reference backend: forward, backward, no host sync, CUDA graph capture and replay.

Skips below SM100 (there the backend refuses, which tests/test_cudnn_backend.py checks on CPU),
except the NVFP4 input-preparation test, which needs only a CUDA GPU (bytes equal to the CPU's,
no host sync).
On SM100+ a missing or unusable nvidia-cudnn-frontend is a failure, not a skip: that is exactly
what these tests are for.
"""

from __future__ import annotations

import pytest
import torch

from moe_reference import expert_mlp_fp64, random_problem, rel_err
from te_fused_moe import fused_moe_mlp
from te_fused_moe.backends import get_backend

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2  # BF16 operands and outputs, FP32 accumulation, vs FP64 on the same BF16 inputs


def _require_sm100():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    if major < 10:
        pytest.skip(f"cuDNN FE's fused grouped GEMM kernels need SM100+, this GPU is sm_{major}{minor}")
    verdict = get_backend("cudnn").availability(torch.device("cuda"))
    assert verdict, f"SM100+ GPU but backend='cudnn' is unavailable: {verdict.reason}"


def _problem(activation, bias, probs, routing="empty", padding=7, T=1000, H=256, F=128, E=8, seed=0):
    p = random_problem(T, H, F, E, activation=activation, dtype=torch.bfloat16, device="cuda", bias=bias,
                       probs=probs, routing=routing, padding=padding, seed=seed, scale=3.0)
    return p


def _run(p, backend, activation, dy, recipe=None):
    leaves = {k: (v.detach().clone().requires_grad_(True) if k in ("x", "w1", "w2", "b1", "b2", "probs") and v is not None
                  else v) for k, v in p.items()}
    y = fused_moe_mlp(leaves["x"], leaves["tokens_per_expert"], leaves["w1"], leaves["w2"], activation=activation,
                      recipe=recipe, b1=leaves["b1"], b2=leaves["b2"], probs=leaves["probs"], backend=backend)
    y.backward(dy)
    return y.detach(), {k: (v.grad if isinstance(v, torch.Tensor) and v.requires_grad else None) for k, v in leaves.items()}


@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss_swiglu"])
@pytest.mark.parametrize("bias,probs", [(False, False), (True, True)])
@pytest.mark.parametrize("routing", ["balanced", "empty", "one"])
def test_cudnn_matches_fp64_and_reference(activation, bias, probs, routing):
    _require_sm100()
    p = _problem(activation, bias, probs, routing)
    dy = torch.randn(p["x"].shape, device="cuda", dtype=torch.bfloat16)
    y, grads = _run(p, "cudnn", activation, dy)
    y_ref, grads_ref = _run(p, "reference", activation, dy)
    fp64 = expert_mlp_fp64(p["x"], p["tokens_per_expert"], p["w1"], p["w2"], activation, b1=p["b1"], b2=p["b2"],
                           probs=p["probs"], dy=dy)
    assert rel_err(y, fp64["y"]) < BF16_TOL
    assert rel_err(y, y_ref) < BF16_TOL
    assert bool((y[-7:] == 0).all())  # padding rows
    for name in ("x", "w1", "w2", "b1", "b2", "probs"):
        if grads[name] is None:
            continue
        assert torch.isfinite(grads[name]).all(), name
        assert rel_err(grads[name], fp64[name]) < BF16_TOL, name
        assert rel_err(grads[name], grads_ref[name]) < BF16_TOL, name


def test_cudnn_never_syncs_after_warmup():
    _require_sm100()
    p = _problem("swiglu", True, True)
    dy = torch.randn(p["x"].shape, device="cuda", dtype=torch.bfloat16)
    _run(p, "cudnn", "swiglu", dy)  # compiles outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(p, "cudnn", "swiglu", dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cudnn_captures_in_a_cuda_graph_and_replays_new_routing():
    _require_sm100()
    p = _problem("swiglu", False, True, routing="balanced", padding=0, seed=1)
    x = p["x"].detach().clone()
    counts = p["tokens_per_expert"].clone()
    w1 = p["w1"].detach().clone().requires_grad_(True)
    w2 = p["w2"].detach().clone().requires_grad_(True)
    probs = p["probs"].clone()
    dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)

    def step():
        w1.grad = w2.grad = None
        y = fused_moe_mlp(x, counts, w1, w2, probs=probs, backend="cudnn")
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # eager warm-up: compiles every kernel of this signature
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = step()
        g1, g2 = w1.grad, w2.grad

    for seed in range(3):
        new = _problem("swiglu", False, True, routing="zipf", padding=11, seed=10 + seed)
        counts.copy_(new["tokens_per_expert"])
        x.copy_(new["x"])
        graph.replay()
        torch.cuda.synchronize()
        eager_y, eager = _run(dict(p, x=x, tokens_per_expert=counts, w1=w1.detach(), w2=w2.detach(), probs=probs),
                              "cudnn", "swiglu", dy)
        assert torch.equal(y_graph, eager_y)
        assert torch.equal(g1, eager["w1"]) and torch.equal(g2, eager["w2"])


def test_first_call_inside_capture_is_refused_with_advice():
    _require_sm100()
    p = _problem("swiglu", False, False, T=512, H=64, F=64, E=2, seed=3)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="run one eager forward"):
        with torch.cuda.graph(graph):
            fused_moe_mlp(p["x"], p["tokens_per_expert"], p["w1"], p["w2"], backend="cudnn")


# --------------------------------------------------------------------------- MXFP8 (block-scaled kernels)

# Same MXFP8 operands as the fake-quantized FP64 loop for FC1 fprop and every weight; the kernels keep
# C in BF16 and accumulate in FP32, so an activation/gradient element near an FP8 rounding tie can
# land one FP8 step away. Relative errors of a few 1e-3 are expected; 3e-2 flags a layout/axis bug
# (a wrong scale swizzle or axis gives O(1) errors; see the CPU mutation test).
MXFP8_TOL = 3e-2


@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss_swiglu", "srelu"])
@pytest.mark.parametrize("bias,probs", [(False, False), (True, True)])
@pytest.mark.parametrize("routing", ["balanced", "empty"])
def test_cudnn_mxfp8_matches_fake_quantized_fp64_and_reference(activation, bias, probs, routing):
    _require_sm100()
    from fake_quant_reference import quantized_expert_mlp_fp64
    from te_fused_moe.recipes import MXFP8BlockScaling

    recipe = MXFP8BlockScaling()
    p = _problem(activation, bias, probs, routing)
    dy = torch.randn(p["x"].shape, device="cuda", dtype=torch.bfloat16)
    y, grads = _run(p, "cudnn", activation, dy, recipe=recipe)
    y_ref, grads_ref = _run(p, "reference", activation, dy, recipe=recipe)
    truth = quantized_expert_mlp_fp64(p["x"], p["tokens_per_expert"], p["w1"], p["w2"], recipe, activation,
                                      b1=p["b1"], b2=p["b2"], probs=p["probs"], dy=dy)
    assert rel_err(y, truth["y"]) < MXFP8_TOL
    assert rel_err(y, y_ref) < MXFP8_TOL
    assert bool((y[-7:] == 0).all())
    for name in ("x", "w1", "w2", "b1", "b2", "probs"):
        if grads[name] is None:
            continue
        assert torch.isfinite(grads[name]).all(), name
        assert rel_err(grads[name], truth[name]) < MXFP8_TOL, name
        assert rel_err(grads[name], grads_ref[name]) < MXFP8_TOL, name


def test_cudnn_mxfp8_never_syncs_after_warmup():
    _require_sm100()
    p = _problem("swiglu", True, True)
    dy = torch.randn(p["x"].shape, device="cuda", dtype=torch.bfloat16)
    _run(p, "cudnn", "swiglu", dy, recipe="mxfp8")  # compiles (and lets cuDNN FE validate offsets) outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(p, "cudnn", "swiglu", dy, recipe="mxfp8")
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------- NVFP4 (FP4 operands, fp4.py)

# Every FP4 operand is made by our quantizer (as the reference's), so with stochastic rounding off
# both sides read the same bytes except where a kernel-written FP32 value (activation, dh) differs
# from the reference's FP32 value by accumulation order and an element crosses an FP4 rounding
# boundary; BF16 outputs add ~4e-3. 3e-2 flags a layout/alpha bug (those give O(1) errors, see the
# CPU mutation test). Counts are multiples of 16: with RHT the reference crops the padded tail of a
# ragged 16-token run, TE and the kernels do not (tests/test_cudnn_nvfp4.py).
NVFP4_TOL = 3e-2


def _nvfp4_problem(activation, bias, probs, routing):
    p = _problem(activation, bias, probs, routing)
    p["tokens_per_expert"] = p["tokens_per_expert"] // 16 * 16
    return p


@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss_swiglu"])
@pytest.mark.parametrize("bias,probs", [(False, False), (True, True)])
@pytest.mark.parametrize("routing", ["balanced", "empty", "one"])
@pytest.mark.parametrize("two_d", [True, False])
def test_cudnn_nvfp4_matches_reference(activation, bias, probs, routing, two_d):
    _require_sm100()
    from te_fused_moe.recipes import NVFP4BlockScaling

    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=not two_d)
    p = _nvfp4_problem(activation, bias, probs, routing)
    dy = torch.randn(p["x"].shape, device="cuda", dtype=torch.bfloat16)
    y, grads = _run(p, "cudnn", activation, dy, recipe=recipe)
    y_ref, grads_ref = _run(p, "reference", activation, dy, recipe=recipe)
    plain = expert_mlp_fp64(p["x"], p["tokens_per_expert"], p["w1"], p["w2"], activation, b1=p["b1"], b2=p["b2"],
                            probs=p["probs"])
    assert rel_err(y, y_ref) < NVFP4_TOL
    assert rel_err(y, plain["y"]) > 1e-2  # FP4 rounding is really applied
    routed = int(p["tokens_per_expert"].sum())
    assert bool((y[routed:] == 0).all())
    for name in ("x", "w1", "w2", "b1", "b2", "probs"):
        if grads[name] is None:
            continue
        assert torch.isfinite(grads[name]).all(), name
        assert rel_err(grads[name], grads_ref[name]) < NVFP4_TOL, name


def test_cudnn_nvfp4_stochastic_rounding_and_no_sync():
    _require_sm100()
    from te_fused_moe.recipes import NVFP4BlockScaling

    recipe = NVFP4BlockScaling()
    p = _nvfp4_problem("swiglu", True, True, "empty")
    dy = torch.randn(p["x"].shape, device="cuda", dtype=torch.bfloat16)
    _run(p, "cudnn", "swiglu", dy, recipe=recipe)  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, grads = _run(p, "cudnn", "swiglu", dy, recipe=recipe)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    y_ref, grads_ref = _run(p, "reference", "swiglu", dy, recipe=recipe)
    assert rel_err(y, y_ref) < NVFP4_TOL  # no stochastic rounding in the forward
    for name in ("x", "w1", "w2"):  # independent SR draws on both sides: same gradient, noisier
        assert rel_err(grads[name], grads_ref[name]) < 0.3, name


def test_nvfp4_operand_preparation_on_any_gpu_matches_cpu_and_never_syncs():
    """The NVFP4 input preparation (padded layout, per-group amax, FP4 quantization, atoms, alpha)
    needs no SM100: on any CUDA GPU (the H200 included) it must give the CPU's bytes and, after
    one warm-up call, never synchronize with the host."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from te_fused_moe.backends.cudnn import fp4, kernels, layouts

    g = torch.Generator().manual_seed(7)
    counts_cpu = torch.tensor([300, 0, 17, 512, 33])
    tokens, hidden, experts = int(counts_cpu.sum()) + 5, 256, counts_cpu.numel()
    x_cpu = (torch.randn(tokens, hidden, generator=g) * torch.exp2(torch.randint(-8, 8, (tokens, 1), generator=g))
             ).to(torch.bfloat16)
    w_cpu = torch.randn(experts, 128, hidden, generator=g).to(torch.bfloat16)

    def prepare(x, w, counts, sr):
        offsets = kernels.kernel_offsets(counts)
        rows = layouts.padded_rows_bound(tokens, experts)
        valid = layouts.valid_row_mask(counts, tokens)
        x_pad = layouts.scatter_to_padded(torch.where(valid[:, None], x, torch.zeros_like(x)),
                                          layouts.padded_row_index(counts, tokens), rows)
        groups = fp4.row_groups(offsets, rows)
        ops = [fp4.quantize_rows(x_pad, groups, experts, stochastic=sr),
               fp4.quantize_columns(x_pad, groups, experts, stochastic=sr, rht=True),
               fp4.quantize_columns(x_pad, groups, experts, stochastic=False, rht=False),
               fp4.quantize_weights(w, block_2d=True), fp4.quantize_weights(w.transpose(1, 2), block_2d=False)]
        return ops, fp4.gemm_alpha(ops[0], ops[3]), fp4.dglu_alpha(ops[0], ops[3])

    x, w, counts = x_cpu.cuda(), w_cpu.cuda(), counts_cpu.cuda()
    prepare(x, w, counts, sr=True)  # fills the per-device caches (decode table, RHT matrix)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu_ops, gpu_alpha, gpu_dglu_alpha = prepare(x, w, counts, sr=False)
        prepare(x, w, counts, sr=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_ops, cpu_alpha, cpu_dglu_alpha = prepare(x_cpu, w_cpu, counts_cpu, sr=False)
    for i, (a, b) in enumerate(zip(gpu_ops, cpu_ops)):
        assert torch.equal(a.data.view(torch.uint8).cpu(), b.data.view(torch.uint8)), i
        assert torch.equal(a.scales.view(torch.uint8).cpu(), b.scales.view(torch.uint8)), i
        assert torch.equal(a.amax.cpu(), b.amax), i
    assert torch.equal(gpu_alpha.cpu(), cpu_alpha)
    torch.testing.assert_close(gpu_dglu_alpha.cpu(), cpu_dglu_alpha, rtol=2e-7, atol=0)  # sqrt may differ by 1 ulp
