"""Activation forward/backward as Triton device functions (FP32 math, same formulas as
``te_fused_moe/activations.py``). Gated ones take (gate, up); non-gated ones ignore ``up``."""

import triton
import triton.language as tl

# Activation ids passed to the kernels as a constexpr.
ACT_IDS = {"swiglu": 0, "geglu": 1, "gpt_oss_swiglu": 2, "srelu": 3, "silu": 4, "gelu": 5}
GATED_IDS = (0, 1, 2)

_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gelu_and_grad(g):
    cdf = 0.5 * (1.0 + tl.math.erf(g * _INV_SQRT2))
    pdf = tl.exp(-0.5 * g * g) * _INV_SQRT_2PI
    return g * cdf, cdf + g * pdf


@triton.jit
def _silu_and_grad(g):
    s = _sigmoid(g)
    return g * s, s * (1.0 + g * (1.0 - s))


@triton.jit
def load_gate_up(h_ptrs, up_offset, mask, GATED: tl.constexpr):
    """(gate, up) in FP32 from the pointers of the gate values and the up half ``up_offset`` elements on
    (``up`` is the gate again for non-gated activations, which read no up half)."""
    g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(h_ptrs + up_offset, mask=mask, other=0.0).to(tl.float32)
    else:
        u = g
    return g, u


@triton.jit
def act_forward(g, u, alpha, limit, ACT: tl.constexpr):
    """Activation value (before the router prob)."""
    if ACT == 0:
        out = g * _sigmoid(g) * u
    elif ACT == 1:
        out = _gelu_and_grad(g)[0] * u
    elif ACT == 2:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        out = gc * _sigmoid(alpha * gc) * (uc + 1.0)
    elif ACT == 3:
        r = tl.maximum(g, 0.0)
        out = r * r
    elif ACT == 4:
        out = g * _sigmoid(g)
    else:
        out = _gelu_and_grad(g)[0]
    return out


@triton.jit
def act_backward(g, u, da, alpha, limit, ACT: tl.constexpr):
    """(d gate, d up, activation value) given the gradient ``da`` of the activation's output.

    For non-gated activations ``d up`` is unused (returned as zeros of the same shape)."""
    zero = tl.zeros_like(g)
    if ACT == 0:
        act, dact = _silu_and_grad(g)
        value = act * u
        dg = da * u * dact
        du = da * act
    elif ACT == 1:
        act, dact = _gelu_and_grad(g)
        value = act * u
        dg = da * u * dact
        du = da * act
    elif ACT == 2:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = _sigmoid(alpha * gc)
        glu = gc * s
        dglu = s * (1.0 + alpha * gc * (1.0 - s))
        value = glu * (uc + 1.0)
        dg = tl.where(g <= limit, da * (uc + 1.0) * dglu, zero)
        du = tl.where((u >= -limit) & (u <= limit), da * glu, zero)
    elif ACT == 3:
        r = tl.maximum(g, 0.0)
        value = r * r
        dg = da * 2.0 * r
        du = zero
    elif ACT == 4:
        act, dact = _silu_and_grad(g)
        value = act
        dg = da * dact
        du = zero
    else:
        act, dact = _gelu_and_grad(g)
        value = act
        dg = da * dact
        du = zero
    return dg, du, value


@triton.jit
def to_output(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """Cast FP32 ``x`` to the output dtype with round-to-nearest-even.

    On the GPU a plain cast already rounds to nearest even. Triton 3.6's CPU interpreter truncates
    FP32 -> BF16 instead, which would triple the rounding error the tests see, so when interpreted we
    round the FP32 bits to the nearest BF16 value first (then the truncating cast is exact)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
