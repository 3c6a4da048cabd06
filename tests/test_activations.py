"""Activations: forward against the FP64 definitions in tests/moe_reference.py, and the
hand-written backwards against finite differences (torch.autograd.gradcheck in FP64)."""

import pytest
import torch

from moe_reference import GATED, activation_fp64
from te_fused_moe.activations import ACTIVATIONS, ActivationConfig, apply_activation

NAMES = sorted(ACTIVATIONS)


def _inputs(name, rows, cols, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    width = 2 * cols if name in GATED else cols
    return (torch.randn(rows, width, generator=g, dtype=torch.float64) * scale).to(dtype)


def _away_from_kinks(h, kinks, gap=1e-3):
    """Push values within ``gap`` of a kink (clamp bound, relu's 0) out of it, so finite
    differences with eps=1e-6 never straddle one."""
    for k in kinks:
        near = (h - k).abs() < gap
        h = torch.where(near, h + torch.where(h >= k, gap, -gap), h)
    return h


def test_registry_matches_reference_definitions():
    assert set(NAMES) == {"swiglu", "geglu", "gpt_oss_swiglu", "srelu", "silu", "gelu"}
    for name in NAMES:
        assert ACTIVATIONS[name].gated == (name in GATED), name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
def test_forward_matches_fp64(name, dtype, tol):
    for seed in range(3):
        h = _inputs(name, 37, 24, dtype, seed)
        out = apply_activation(h, ActivationConfig(name))
        assert out.dtype == dtype
        ref = activation_fp64(name, h.double())
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < tol, (name, dtype, err)
        # elementwise too, so that one wrong column can't hide in the norm
        assert torch.allclose(out.double(), ref, rtol=tol * 4, atol=tol * 4), name


@pytest.mark.parametrize("name", NAMES)
def test_backward_gradcheck_fp64(name):
    limit = 7.0
    h = _inputs(name, 9, 8, torch.float64, seed=11, scale=4.0)
    h = _away_from_kinks(h, [0.0, limit, -limit])
    h.requires_grad_(True)
    cfg = ActivationConfig(name)
    assert torch.autograd.gradcheck(lambda t: apply_activation(t, cfg), (h,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("alpha,limit", [(1.702, 7.0), (1.0, 2.5)])
def test_gpt_oss_clamp_near_limits(alpha, limit):
    """Inputs straddling +limit (gate) and +-limit (up), just inside and just outside."""
    offsets = torch.tensor([-0.3, -0.02, -0.002, 0.002, 0.02, 0.3], dtype=torch.float64)
    g = torch.cat([limit + offsets, torch.linspace(-3, 3, 6, dtype=torch.float64)])
    u = torch.cat([limit + offsets.flip(0), -limit + offsets])
    gate, up = torch.meshgrid(g, u, indexing="ij")
    h = torch.cat([gate.reshape(-1, 1), up.reshape(-1, 1)], dim=1).reshape(12, 24)
    # reorganise as [rows, 2F]: first F columns gate, last F up
    h = torch.cat([h[:, 0::2], h[:, 1::2]], dim=1).contiguous().requires_grad_(True)
    cfg = ActivationConfig("gpt_oss_swiglu", alpha=alpha, limit=limit)

    out = apply_activation(h, cfg)
    ref = activation_fp64("gpt_oss_swiglu", h.detach(), alpha=alpha, limit=limit)
    assert torch.allclose(out, ref, rtol=1e-13, atol=1e-13)
    assert torch.autograd.gradcheck(lambda t: apply_activation(t, cfg), (h,), eps=1e-6, atol=1e-8, rtol=1e-6)

    # Clamped inputs get exactly zero gradient; the others a non-zero one.
    dh = torch.autograd.grad(out.sum(), h)[0]
    gate_raw, up_raw = h.detach().chunk(2, dim=1)
    dgate, dup = dh.chunk(2, dim=1)
    assert torch.all(dgate[gate_raw > limit] == 0)
    assert torch.all(dup[up_raw.abs() > limit] == 0)
    assert torch.all(dup[up_raw.abs() < limit] != 0)


@pytest.mark.parametrize("name", NAMES)
def test_low_precision_backward_computed_in_fp32(name):
    """bf16 input: the gradient is the FP32 gradient rounded once to bf16."""
    h = _inputs(name, 16, 32, torch.bfloat16, seed=5)
    da = torch.randn(h.shape[0], h.shape[1] // 2 if name in GATED else h.shape[1]).to(torch.bfloat16)
    h.requires_grad_(True)
    out = apply_activation(h, ActivationConfig(name))
    (dh,) = torch.autograd.grad(out, h, da)
    assert dh.dtype == torch.bfloat16
    h64 = h.detach().double().requires_grad_(True)
    (ref,) = torch.autograd.grad(activation_fp64(name, h64), h64, da.double())
    err = ((dh.double() - ref).norm() / ref.norm()).item()
    assert err < 8e-3, (name, err)
