"""cuDNN backend, NVFP4 path, on CPU: input preparation and the glue against the kernels'
documented FP4 contract.

No SM100 GPU is reachable here (tests/gpu/test_cudnn_sm100.py has the NVFP4 case for one). This
file checks:

* the operands ``backends/cudnn/fp4.py`` builds — FP4 bytes, E4M3 1x16 scales (read back from the
  128x4 atoms with this file's own index formula), per-group tensor amax — bit for bit against
  ``quantize/nvfp4.py`` applied to each expert's slice as the reference backend does (rowwise,
  token-innermost columnwise with and without RHT, 2D/1D weights);
* the whole op (``run_expert_mlp`` with ``DocumentedNVFP4Emulator``) against the reference backend
  with the same NVFP4 recipe (stochastic rounding off, so both sides see the same bytes): bound
  below; stochastic rounding on: forward identical, gradients differ but stay close;
* refusals and mutations (wrong alpha, wrong swizzle, one tensor scale for all experts).

``DocumentedNVFP4Emulator`` is a stand-in for cuDNN Frontend 1.32's documented/read contract with
FP4 operands: ``float4_e2m1fn_x2`` data packed along the stride-1 dimension (low nibble first),
E4M3 scales per 16 elements in 128x4 atoms, per-group FP32 ``alpha`` applied once by the GLU and
quant kernels and squared by the dGLU kernel (``square_alpha`` in
``moe_blockscaled_grouped_gemm_dglu_dbias.py``), ``global_scale_a * global_scale_b`` by the wgrad
kernel; FP32 D allowed only with a fused bias / dbias (the wrappers' NotImplementedError). Rows
outside every group come back NaN, as unwritten memory. It checks our glue against our reading of
the kernels; it cannot show the kernels behave as read.
"""

from __future__ import annotations

import pytest
import torch

from moe_reference import expert_mlp_fp64, random_problem, rel_err
from test_cudnn_backend import (
    DocumentedKernelEmulator,
    _atom_offset,
    _documented_dglu_rows,
    _documented_glu,
)
from te_fused_moe.activations import ActivationConfig
from te_fused_moe.backends import ExpertMLPArgs, get_backend
from te_fused_moe.backends.cudnn import BACKEND, fp4, kernels, layouts
from te_fused_moe.quantize import hadamard, nvfp4
from te_fused_moe.recipes import NVFP4BlockScaling

FP4 = torch.float4_e2m1fn_x2
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign (OCP MX spec)
# Same quantized operands on both sides; what differs is the FP32 rounding of alpha (and of
# sqrt(alpha) squared in dGLU), of C/D/dh (FP32 buffers the kernels write) and the order of sums.
BOUND = 1e-5


# --------------------------------------------------------------------------- reading FP4 operands (independent)

def _read_scales(atoms, batch, rows, cols):
    """E4M3 scales [batch, rows, cols] (float64) read through ``_atom_offset`` (cuBLAS 128x4 layout)."""
    flat = atoms.contiguous().view(torch.uint8).reshape(-1)
    l, r, c = torch.meshgrid(torch.arange(batch), torch.arange(rows), torch.arange(cols), indexing="ij")
    return flat[_atom_offset(l, r, c, -(-rows // 128), -(-cols // 4))].view(torch.float8_e4m3fn).double()


def _unpack(data):
    """Packed FP4 ``[..., C/2]`` (contiguous) -> E2M1 values ``[..., C]`` in float64, low nibble first."""
    assert data.dtype == FP4 and data.is_contiguous()
    b = data.view(torch.uint8)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], -1).long()
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def _fp4_values(data, atoms):
    """``data [R, C/2]`` or ``[L, R, C/2]`` with 1x16 scales along C -> float64 ``[(L,) R, C]`` (no tensor scale)."""
    vals = _unpack(data)
    squeeze = vals.dim() == 2
    if squeeze:
        vals = vals.unsqueeze(0)
    batch, rows, cols = vals.shape
    scales = _read_scales(atoms, batch, rows, cols // 16).repeat_interleave(16, dim=2)
    out = vals * scales
    return out[0] if squeeze else out


class DocumentedNVFP4Emulator(DocumentedKernelEmulator):
    def __init__(self):
        super().__init__()
        self.alphas = {}

    @staticmethod
    def _check_alpha(alpha, experts):
        assert alpha.dtype == torch.float32 and tuple(alpha.shape) == (experts,)
        return alpha.double()

    def grouped_gemm_glu_wrapper_sm100(self, *, a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor,
                                       sfb_tensor, bias_tensor, prob_tensor, norm_const_tensor, c_dtype, d_dtype,
                                       sf_vec_size, m_aligned, act_func, linear_offset, generate_c):
        self.calls.append("glu")
        assert a_tensor.dtype == FP4 and b_tensor.dtype == FP4 and sf_vec_size == 16 and m_aligned == 256
        assert sfa_tensor.dtype == torch.float8_e4m3fn and sfb_tensor.dtype == torch.float8_e4m3fn and generate_c
        assert d_dtype in (torch.float16, torch.bfloat16, torch.float32)  # no FP4 D with FP4 operands
        if d_dtype == torch.float32 and bias_tensor is None:
            raise NotImplementedError("fp4 ab_dtype, sf_vec_size 16, d_dtype float32 is not supported")
        assert bias_tensor.stride() == (1, bias_tensor.shape[0])
        a, b = _fp4_values(a_tensor, sfa_tensor), _fp4_values(b_tensor, sfb_tensor)
        alpha = self._check_alpha(alpha_tensor, b.shape[0])
        self.alphas["glu"] = alpha_tensor.clone()
        m, n = a.shape[0], b.shape[1]
        c, d = self._nan(m, n, c_dtype), self._nan(m, n // 2, d_dtype)
        for g, s, e in self._groups(padded_offsets):
            acc = alpha[g] * (a[s:e] @ b[g].T) + bias_tensor[:, g].double()
            c[s:e] = acc
            d[s:e] = prob_tensor[s:e, None] * _documented_glu(acc, act_func, linear_offset)
        return {"c_tensor": c, "d_tensor": d}

    def grouped_gemm_quant_wrapper_sm100(self, *, a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor,
                                         sfb_tensor, norm_const_tensor, d_dtype, sf_vec_size, m_aligned,
                                         generate_amax, bias_tensor=None):
        self.calls.append("quant_gemm")
        assert a_tensor.dtype == FP4 and sf_vec_size == 16 and norm_const_tensor.tolist() == [1.0]
        a, b = _fp4_values(a_tensor, sfa_tensor), _fp4_values(b_tensor, sfb_tensor)
        alpha = self._check_alpha(alpha_tensor, b.shape[0])
        d = self._nan(a.shape[0], b.shape[1], d_dtype)
        for g, s, e in self._groups(padded_offsets):
            d[s:e] = alpha[g] * (a[s:e] @ b[g].T) + (bias_tensor[:, g] if bias_tensor is not None else 0)
        return {"d_tensor": d}

    def grouped_gemm_dglu_wrapper_sm100(self, *, a_tensor, c_tensor, sfa_tensor, padded_offsets, alpha_tensor,
                                        beta_tensor, prob_tensor, dprob_tensor, b_tensor, sfb_tensor, generate_dbias,
                                        norm_const_tensor, d_dtype, sf_vec_size, m_aligned, act_func, linear_offset,
                                        deterministic):
        self.calls.append("dglu")
        assert a_tensor.dtype == FP4 and sf_vec_size == 16 and bool((dprob_tensor == 0).all())
        if d_dtype == torch.float32 and not generate_dbias:
            raise NotImplementedError("fp4 ab_dtype, sf_vec_size 16, d_dtype float32 is not supported")
        if deterministic and generate_dbias:
            raise NotImplementedError("deterministic dprob is implemented only for the SM100 kernel without dbias")
        a, b = _fp4_values(a_tensor, sfa_tensor), _fp4_values(b_tensor, sfb_tensor)
        alpha = self._check_alpha(alpha_tensor, b.shape[0])
        m, n2 = c_tensor.shape
        d_row = self._nan(m, n2, d_dtype)
        dbias = torch.zeros(b.shape[0], n2, 1, dtype=torch.float64)
        for g, s, e in self._groups(padded_offsets):
            r = alpha[g] * alpha[g] * (a[s:e] @ b[g].T)  # the kernel's square_alpha
            rows_dh, rows_dprob = _documented_dglu_rows(c_tensor[s:e].double(), r, prob_tensor[s:e, None], act_func,
                                                        linear_offset, beta_tensor[g])
            d_row[s:e] = rows_dh
            dprob_tensor[s:e] += rows_dprob
            dbias[g, :, 0] = rows_dh.sum(dim=0)
        return {"d_row_tensor": d_row, "dprob_tensor": dprob_tensor,
                "dbias_tensor": dbias if generate_dbias else None}

    def grouped_gemm_wgrad_wrapper_sm100(self, *, a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor,
                                         wgrad_dtype, sf_vec_size, global_scale_a, global_scale_b):
        self.calls.append("wgrad")
        assert sf_vec_size == 16 and a_tensor.dtype == FP4 and b_tensor.dtype == FP4
        assert a_tensor.stride(1) == 1 and b_tensor.stride(0) == 1  # K-major (token-innermost) A and B
        experts = offsets_tensor.shape[0]
        ga, gb = self._check_alpha(global_scale_a, experts), self._check_alpha(global_scale_b, experts)
        a = _fp4_values(a_tensor, sfa_tensor)  # (m, tokens)
        b = _fp4_values(b_tensor.t(), sfb_tensor).T  # (tokens, n)
        out = torch.full((experts, a.shape[0], b.shape[1]), float("nan"), dtype=wgrad_dtype)
        for g, s, e in self._groups(offsets_tensor):
            if e > s:
                out[g] = (ga[g] * gb[g]) * (a[:, s:e] @ b[s:e])
        return {"wgrad_tensor": out}


# --------------------------------------------------------------------------- operand preparation, bit-exact

def _slices(counts):
    """(expert, packed start, padded start, rows) for each expert."""
    out, start, pstart = [], 0, 0
    for e, n in enumerate(counts.tolist()):
        out.append((e, start, pstart, n))
        start += n
        pstart += -(-n // 256) * 256
    return out


def _padded(t, counts):
    rows = layouts.padded_rows_bound(t.shape[0], counts.shape[0])
    index = layouts.padded_row_index(counts, t.shape[0])
    valid = layouts.valid_row_mask(counts, t.shape[0])
    return layouts.scatter_to_padded(torch.where(valid[:, None], t, torch.zeros_like(t)), index, rows)


@pytest.mark.parametrize("routing", ["zipf", "empty", "one"])
def test_rowwise_operand_is_our_quantizer_per_expert(routing):
    g = torch.Generator().manual_seed(11)
    counts = torch.tensor({"zipf": [300, 17, 0, 90], "empty": [0, 0, 129, 0], "one": [0, 0, 0, 436]}[routing])
    tokens, k = int(counts.sum()) + 3, 96
    mags = torch.exp2(torch.randint(-8, 8, (tokens, 1), generator=g).float())  # experts of very different range
    x = (torch.randn(tokens, k, generator=g) * mags).to(torch.bfloat16)
    offsets = kernels.kernel_offsets(counts)
    x_pad = _padded(x, counts)
    groups = fp4.row_groups(offsets, x_pad.shape[0])
    op = fp4.quantize_rows(x_pad, groups, 4, stochastic=False)
    assert op.data.dtype == FP4 and op.data.shape == (x_pad.shape[0], k // 2)
    assert tuple(op.scales.shape) == layouts.swizzled_scale_shape(x_pad.shape[0], k // 16)
    scales = _read_scales(op.scales, 1, x_pad.shape[0], k // 16)[0]
    for e, s, ps, n in _slices(counts):
        if n == 0:
            assert float(op.amax[e]) == 0.0
            continue
        q = nvfp4.quantize(x[s:s + n], axis=1)
        assert float(op.amax[e]) == float(q.global_amax)
        assert torch.equal(op.data[ps:ps + n].view(torch.uint8), q.data)
        assert torch.equal(scales[ps:ps + n], q.scale.double())
        assert bool((op.data[ps + n:ps + -(-n // 256) * 256].view(torch.uint8) == 0).all())  # zero padding rows
        # FP64 values through the emulator's reading + the per-group dequant scale = our dequantize
        vals = _fp4_values(op.data[ps:ps + n].contiguous(), layouts.swizzle_scales(
            layouts.unswizzle_scales(op.scales, x_pad.shape[0], k // 16)[0][ps:ps + n]))
        deq = vals * float(op.amax[e]) / 2688.0  # FP64: only the order of the products differs
        torch.testing.assert_close(deq, nvfp4.dequantize(q, dtype=torch.float64), rtol=5e-16, atol=0)


@pytest.mark.parametrize("rht", [False, True])
def test_columnwise_operand_is_token_innermost_and_restarts_per_expert(rht):
    g = torch.Generator().manual_seed(12)
    counts = torch.tensor([37, 0, 260, 5])
    tokens, n_cols = int(counts.sum()), 48
    t = torch.randn(tokens, n_cols, generator=g) * torch.exp2(torch.randint(-6, 6, (tokens, 1), generator=g).float())
    offsets = kernels.kernel_offsets(counts)
    t_pad = _padded(t, counts)
    m = t_pad.shape[0]
    op = fp4.quantize_columns(t_pad, fp4.row_groups(offsets, m), 4, stochastic=False, rht=rht)
    assert op.data.dtype == FP4 and op.data.shape == (n_cols, m // 2) and op.data.is_contiguous()
    scales = _read_scales(op.scales, 1, n_cols, m // 16)[0]
    for e, s, ps, n in _slices(counts):
        if n == 0:
            continue
        # the reference: the expert's slice on its own, transformed along tokens (padded to 16) when RHT is on
        src = hadamard.apply_rht(t[s:s + n], axis=0) if rht else t[s:s + n]
        q = nvfp4.quantize(src, axis=0)
        nbytes, nblocks = q.data.shape[0], q.scale.shape[0]  # an odd count ends with a zero nibble, as padding
        assert float(op.amax[e]) == float(q.global_amax)
        assert torch.equal(op.data.view(torch.uint8)[:, ps // 2:ps // 2 + nbytes], q.data.t()), e
        assert torch.equal(scales[:, ps // 16:ps // 16 + nblocks], q.scale.t().double()), e


@pytest.mark.parametrize("block_2d", [True, False])
def test_weight_operands_are_our_quantizer_per_expert(block_2d):
    g = torch.Generator().manual_seed(13)
    e_count, n, k = 3, 128, 64
    w = (torch.randn(e_count, n, k, generator=g) * torch.tensor([1e-3, 1.0, 40.0])[:, None, None]).to(torch.bfloat16)
    w_k = layouts.interleave_glu(w, dim=1)
    for src, interleaved in ((w_k, True), (w.transpose(1, 2).contiguous(), False)):
        op = fp4.quantize_weights(src, block_2d)
        rows, cols = src.shape[1], src.shape[2]
        assert op.data.shape == (e_count, rows, cols // 2)
        scales = _read_scales(op.scales, e_count, rows, cols // 16)
        data = op.data.view(torch.uint8)
        if interleaved:
            data, scales = layouts.deinterleave_glu(data, dim=1), layouts.deinterleave_glu(scales, dim=1)
        for e in range(e_count):
            plain = w[e] if interleaved else w[e].t()
            q = nvfp4.quantize(plain, axis=1, block_2d=block_2d)
            assert float(op.amax[e]) == float(q.global_amax)
            assert torch.equal(data[e], q.data)
            want = q.scale.double().repeat_interleave(16, dim=0) if block_2d else q.scale.double()
            assert torch.equal(scales[e], want)


def test_segmented_amax_and_alpha():
    g = torch.Generator().manual_seed(14)
    values = torch.randn(768, 8, generator=g) * 3
    values[5, 2] = float("nan")  # skipped, as TE's amax does
    offsets = torch.tensor([256, 256, 768], dtype=torch.int32)
    amax = fp4.segmented_amax(values, fp4.row_groups(offsets, 768), 3)
    assert torch.equal(amax, torch.stack([values[:256].nan_to_num(0).abs().max(), torch.tensor(0.0),
                                          values[256:].abs().max()]))
    op = fp4.FP4Operand(None, None, amax)
    alpha = fp4.gemm_alpha(op, op)
    assert alpha.dtype == torch.float32 and float(alpha[1]) == 0.0
    assert torch.allclose(alpha.double(), (amax.double() / 2688) ** 2, rtol=2e-7, atol=0)


# --------------------------------------------------------------------------- the whole op on the emulator

def _run(activation="swiglu", bias=True, probs=True, routing="balanced", padding=3, recipe=None, fe=None, seed=0,
         T=90, E=3, H=64, F=64, dy=None):
    recipe = recipe or NVFP4BlockScaling(disable_stochastic_rounding=True)
    problem = random_problem(T=T, H=H, F=F, E=E, activation=activation, dtype=torch.float64, bias=bias, probs=probs,
                             routing=routing, padding=padding, scale=3.0, seed=seed)
    if not recipe.disable_rht:
        # The reference crops qdq(t M) M^T back to an expert's rows, which drops the padded tail of a
        # ragged 16-token run; TE (and the kernels) multiply the transformed operands whole, and TE
        # requires multiples of 16 there. So with RHT both agree on counts that are multiples of 16;
        # the rows cut off here become caller padding.
        problem["tokens_per_expert"] = problem["tokens_per_expert"] // 16 * 16

    def leaves():
        return {k: (v.clone().requires_grad_(True) if k in ("x", "w1", "w2", "b1", "b2", "probs") and v is not None
                    else v) for k, v in problem.items()}

    def args_of(lv):
        return ExpertMLPArgs(x=lv["x"], tokens_per_expert=lv["tokens_per_expert"], w1=lv["w1"], w2=lv["w2"],
                             activation=ActivationConfig(activation), recipe=recipe, b1=lv["b1"], b2=lv["b2"],
                             probs=lv["probs"])

    ours, ref = leaves(), leaves()
    fe = fe or DocumentedNVFP4Emulator()
    y = kernels.run_expert_mlp(fe, args_of(ours))
    if dy is None:
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    y.backward(dy)
    y_ref = get_backend("reference").forward(args_of(ref))
    y_ref.backward(dy)
    errors = {"y": rel_err(y, y_ref)}
    for name in ("x", "w1", "w2", "b1", "b2", "probs"):
        if ours[name] is not None:
            errors[name] = rel_err(ours[name].grad, ref[name].grad)
    plain = expert_mlp_fp64(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"], activation,
                            b1=problem["b1"], b2=problem["b2"], probs=problem["probs"])
    errors["vs_unquantized_y"] = rel_err(y, plain["y"])
    if recipe.disable_stochastic_rounding:  # and the independent FP64 loop on fake-quantized operands
        from fake_quant_reference import quantized_expert_mlp_fp64

        loop = quantized_expert_mlp_fp64(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"],
                                         recipe, activation, b1=problem["b1"], b2=problem["b2"],
                                         probs=problem["probs"], dy=dy)
        errors["loop_y"] = rel_err(y, loop["y"])
        for name in ("x", "w1", "w2", "b1", "b2", "probs"):
            if ours[name] is not None:
                errors["loop_" + name] = rel_err(ours[name].grad, loop[name])
    return fe, errors, y, ours, dy


RECIPES = {
    "default_no_sr": NVFP4BlockScaling(disable_stochastic_rounding=True),
    "default_1d_w": NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=True),
    "no_rht_1d_w": NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True,
                                     disable_2d_quantization=True),
}


@pytest.mark.parametrize("activation,bias,probs,routing,padding,recipe", [
    ("swiglu", True, True, "balanced", 3, "default_no_sr"),
    ("gpt_oss_swiglu", True, True, "empty", 0, "default_no_sr"),
    ("swiglu", True, True, "one", 0, "default_1d_w"),
    ("swiglu", False, False, "zipf", 5, "no_rht_1d_w"),
    ("gpt_oss_swiglu", False, True, "one", 2, "no_rht_1d_w"),
])
def test_nvfp4_glue_on_documented_contract_matches_reference_backend(activation, bias, probs, routing, padding,
                                                                     recipe):
    fe, errors, y, leaves, _ = _run(activation, bias, probs, routing, padding, RECIPES[recipe], seed=21)
    assert fe.calls == ["glu", "quant_gemm", "dglu", "quant_gemm", "wgrad", "wgrad"]
    assert errors.pop("vs_unquantized_y") > 1e-2, errors  # FP4 rounding is really applied
    for name, err in errors.items():
        assert err < BOUND, (name, errors)
    if padding:
        assert bool((y[-padding:] == 0).all()) and bool((leaves["x"].grad[-padding:] == 0).all())


def test_nvfp4_every_expert_empty_gives_zeros():
    _, errors, y, leaves, _ = _run(routing="balanced", T=9, padding=9)
    assert bool((y == 0).all()) and bool((leaves["x"].grad == 0).all()) and bool((leaves["w1"].grad == 0).all())
    assert bool((leaves["w2"].grad == 0).all()) and not bool(torch.isnan(leaves["w1"].grad).any())


def test_nvfp4_stochastic_rounding_applies_to_gradients_only():
    dy = torch.randn(90, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    _, _, y_rne, rne, _ = _run(seed=31, dy=dy)
    torch.manual_seed(0)
    _, errors, y_sr, sr, _ = _run(seed=31, dy=dy, recipe=NVFP4BlockScaling())
    assert torch.equal(y_sr, y_rne)  # no stochastic rounding in the forward
    for name in ("x", "w1", "w2"):
        diff = rel_err(sr[name].grad, rne[name].grad)
        assert 1e-4 < diff < 0.3, (name, diff)  # really stochastic, and still the same gradient
    assert errors["b2"] < BOUND  # db2 is a plain sum of dy


def test_nvfp4_mutations_are_caught(monkeypatch):
    """A wrong tensor-scale factor, a swizzle without the 32x4 interleave, or one tensor scale
    for all experts (instead of one per expert) must fail the bound."""
    from te_fused_moe.backends.cudnn import fp4 as module

    with monkeypatch.context() as patch:  # alpha built from 1/448 instead of 1/(6*448)
        patch.setattr(module, "dequant_scale", lambda amax: amax / 448.0)
        _, errors, _, _, _ = _run(seed=41)
        assert errors["y"] > 1e-2, errors

    with monkeypatch.context() as patch:  # dGLU alpha not square-rooted: the kernel squares it
        patch.setattr(module, "dglu_alpha", module.gemm_alpha)
        _, errors, _, _, _ = _run(seed=41)
        assert errors["y"] < BOUND and errors["x"] > 1e-2, errors

    def naive_swizzle(scales, fill=None):
        s = scales if scales.dim() == 3 else scales.unsqueeze(0)
        padded = torch.zeros(s.shape[0], -(-s.shape[1] // 128) * 128, -(-s.shape[2] // 4) * 4,
                             dtype=torch.uint8).view(s.dtype)
        padded[:, :s.shape[1], :s.shape[2]] = s
        return padded.reshape(s.shape[0], padded.shape[1] // 128, padded.shape[2] // 4, 32, 4, 4)

    with monkeypatch.context() as patch:
        patch.setattr(module, "swizzle_scales", naive_swizzle)
        _, errors, _, _, _ = _run(seed=41)
        assert errors["y"] > 1e-2, errors

    real = module.segmented_amax

    def one_scale_for_all(values, groups, experts):
        return real(values, groups, experts).amax().expand(experts).clone()

    with monkeypatch.context() as patch:
        patch.setattr(module, "segmented_amax", one_scale_for_all)
        _, errors, _, _, _ = _run(seed=41, routing="zipf")
        assert max(errors["y"], errors["x"], errors["w1"], errors["w2"]) > 1e-4, errors


def test_nvfp4_supports_and_refusals():
    nv = NVFP4BlockScaling()
    for recipe in (nv, NVFP4BlockScaling(disable_rht=True), NVFP4BlockScaling(disable_2d_quantization=True),
                   NVFP4BlockScaling(disable_stochastic_rounding=True)):
        for act in ("swiglu", "gpt_oss_swiglu"):
            assert BACKEND.supports(ActivationConfig(act), recipe, torch.bfloat16)
    verdict = BACKEND.supports(ActivationConfig("srelu"), nv, torch.bfloat16)
    assert not verdict and "swiglu and gpt_oss_swiglu only" in verdict.reason
    assert "take bfloat16" in BACKEND.supports(ActivationConfig("swiglu"), nv, torch.float16).reason

    problem = random_problem(T=40, H=64, F=32, E=2, dtype=torch.float64, probs=True)
    base = dict(x=problem["x"], tokens_per_expert=problem["tokens_per_expert"], w1=problem["w1"], w2=problem["w2"],
                probs=problem["probs"], activation=ActivationConfig("swiglu"), recipe=nv)
    args = ExpertMLPArgs(**base, deterministic=True)
    assert "deterministic" in BACKEND.supports_args(args).reason
    with pytest.raises(ValueError, match="deterministic: .*excludes dbias"):
        kernels.run_expert_mlp(DocumentedNVFP4Emulator(), args)
    args = ExpertMLPArgs(**dict(base, x=problem["x"][:, :48].contiguous(), w1=problem["w1"][:, :, :48].contiguous(),
                                w2=problem["w2"][:, :48].contiguous()))
    assert not BACKEND.supports_args(args)
    with pytest.raises(ValueError, match="H to be a multiple of 32"):
        kernels.run_expert_mlp(DocumentedNVFP4Emulator(), args)
    assert BACKEND.supports_args(ExpertMLPArgs(**base))


# --------------------------------------------------------------------------- every operand of a whole run, bit-exact

class RecordingNVFP4Emulator(DocumentedNVFP4Emulator):
    """Keeps every call's arguments and outputs, in call order."""

    def __init__(self):
        super().__init__()
        self.log = []

    def _record(self, name, kw, out):
        self.log.append((name, kw, out))
        return out

    def grouped_gemm_glu_wrapper_sm100(self, **kw):
        return self._record("glu", kw, super().grouped_gemm_glu_wrapper_sm100(**kw))

    def grouped_gemm_quant_wrapper_sm100(self, **kw):
        return self._record("quant_gemm", kw, super().grouped_gemm_quant_wrapper_sm100(**kw))

    def grouped_gemm_dglu_wrapper_sm100(self, **kw):
        return self._record("dglu", {k: (v.clone() if k == "dprob_tensor" else v) for k, v in kw.items()},
                            super().grouped_gemm_dglu_wrapper_sm100(**kw))

    def grouped_gemm_wgrad_wrapper_sm100(self, **kw):
        return self._record("wgrad", kw, super().grouped_gemm_wgrad_wrapper_sm100(**kw))


def _same_or_neighbour(ours, ref, where):
    """E2M1 codes equal, or stochastically rounded to the other neighbour of the value (one grid
    step apart in magnitude, same sign unless one is zero)."""
    mo, mr = (ours & 7).long(), (ref & 7).long()
    sign_ok = ((ours >> 3) == (ref >> 3)) | (mo == 0) | (mr == 0)
    assert bool((((mo - mr).abs() <= 1) & sign_ok).all()), where


SR_SEEN = []  # (operand, fraction of codes that differ from round-to-nearest-even)


def _expect_rows(data, atoms, src, counts, stochastic=False):
    """``data``/``atoms`` (padded rows, 1x16 along columns) hold nvfp4.quantize of each expert's rows of
    ``src`` (padded layout) with that expert's own amax; returns the amax per expert."""
    rows, cols = src.shape
    scales = _read_scales(atoms, 1, rows, cols // 16)[0]
    amax = []
    for e, _, ps, n in _slices(counts):
        q = nvfp4.quantize(src[ps:ps + n], axis=1) if n else None
        amax.append(float(q.global_amax) if n else 0.0)
        if n:
            ours, ref = data[ps:ps + n].view(torch.uint8), q.data
            if stochastic:
                ours, ref = nvfp4.unpack_e2m1(ours, 1, cols), nvfp4.unpack_e2m1(ref, 1, cols)
                _same_or_neighbour(ours, ref, e)
                SR_SEEN.append(float((ours != ref).double().mean()))
            else:
                assert torch.equal(ours, ref), e
            assert torch.equal(scales[ps:ps + n], q.scale.double()), e  # SR never changes a scale
    return torch.tensor(amax, dtype=torch.float64)


def _expect_cols(data, atoms, src, counts, rht, stochastic=False):
    """Token-innermost copies: nvfp4.quantize along the tokens of each expert's (RHT'd) rows."""
    rows, cols = src.shape
    scales = _read_scales(atoms, 1, cols, rows // 16)[0]
    amax = []
    for e, _, ps, n in _slices(counts):
        if not n:
            amax.append(0.0)
            continue
        part = hadamard.apply_rht(src[ps:ps + n], axis=0) if rht else src[ps:ps + n]
        q = nvfp4.quantize(part, axis=0)
        amax.append(float(q.global_amax))
        length = q.shape[0]  # n, or n rounded up to 16 after the RHT
        whole = -(-length // 16) * 16  # the group's 16-token blocks
        ours = nvfp4.unpack_e2m1(data.view(torch.uint8)[:, ps // 2:(ps + whole) // 2], 1, whole)
        ref = nvfp4.unpack_e2m1(q.data.t(), 1, length)
        if stochastic:
            _same_or_neighbour(ours[:, :length], ref, e)
            SR_SEEN.append(float((ours[:, :length] != ref).double().mean()))
        else:
            assert torch.equal(ours[:, :length], ref), e
        # Padding rows may hold -0 (the kernels write dh = 0 * negative): code 8, value 0, like +0.
        assert bool(((ours[:, length:] == 0) | (ours[:, length:] == 8)).all()), e
        assert torch.equal(scales[:, ps // 16:ps // 16 + q.scale.shape[0]], q.scale.t().double()), e
    return torch.tensor(amax, dtype=torch.float64)


def _expect_weights(data, atoms, weights, block_2d):
    """``weights``: the per-expert [N, K] matrices the kernel's B should hold, quantized along K."""
    e_count, n, half = data.shape
    scales = _read_scales(atoms, e_count, n, half * 2 // 16)
    amax = []
    for e, w in enumerate(weights):
        q = nvfp4.quantize(w, axis=1, block_2d=block_2d)
        amax.append(float(q.global_amax))
        assert torch.equal(data[e].view(torch.uint8), q.data), e
        want = q.scale.double().repeat_interleave(16, dim=0)[:n] if block_2d else q.scale.double()
        assert torch.equal(scales[e], want), e
    return torch.tensor(amax, dtype=torch.float64)


def _check_alpha(alpha, amax_a, amax_b, squared=False):
    want = amax_a * amax_b / 2688.0 ** 2
    got = alpha.double() ** 2 if squared else alpha.double()
    torch.testing.assert_close(got, want, rtol=5e-7, atol=0)


@pytest.mark.parametrize("recipe", ["default_no_sr", "no_rht_1d_w", "default_sr"])
def test_every_operand_of_a_run_is_our_quantizer_per_expert(recipe):
    """With stochastic rounding the gradient operands (dy, dh: rowwise and columnwise) must be
    rounded to a neighbour of the RNE value with identical scales, and really differ somewhere,
    while every other operand stays bit-exact."""
    recipe = RECIPES.get(recipe, NVFP4BlockScaling())
    rht, two_d = not recipe.disable_rht, not recipe.disable_2d_quantization
    sr = not recipe.disable_stochastic_rounding
    SR_SEEN.clear()
    fe = RecordingNVFP4Emulator()
    _, _, _, leaves, dy = _run(routing="zipf", recipe=recipe, fe=fe, seed=51, padding=4)
    counts = leaves["tokens_per_expert"]
    (_, glu, glu_out), (_, fc2, _), (_, dglu, dglu_out), (_, dgrad, _), (_, wg1, _), (_, wg2, _) = fe.log
    w1, w2 = leaves["w1"].detach(), leaves["w2"].detach()
    w1_k = layouts.interleave_glu(w1, dim=1)
    x_pad, dy_pad = _padded(leaves["x"].detach(), counts), _padded(dy, counts)
    act, dh = glu_out["d_tensor"], dglu_out["d_row_tensor"]  # FP32, padded layout, from the kernels

    ax = _expect_rows(glu["a_tensor"], glu["sfa_tensor"], x_pad, counts)
    aw1 = _expect_weights(glu["b_tensor"], glu["sfb_tensor"], list(w1_k), two_d)
    _check_alpha(glu["alpha_tensor"], ax, aw1)
    aact = _expect_rows(fc2["a_tensor"], fc2["sfa_tensor"], act, counts)
    aw2 = _expect_weights(fc2["b_tensor"], fc2["sfb_tensor"], list(w2), two_d)
    _check_alpha(fc2["alpha_tensor"], aact, aw2)
    ady = _expect_rows(dglu["a_tensor"], dglu["sfa_tensor"], dy_pad, counts, stochastic=sr)
    aw2t = _expect_weights(dglu["b_tensor"], dglu["sfb_tensor"], [w.t() for w in w2], two_d)
    _check_alpha(dglu["alpha_tensor"], ady, aw2t, squared=True)
    adh = _expect_rows(dgrad["a_tensor"], dgrad["sfa_tensor"], dh, counts, stochastic=sr)
    aw1t = _expect_weights(dgrad["b_tensor"], dgrad["sfb_tensor"], [w.t() for w in w1_k], two_d)
    _check_alpha(dgrad["alpha_tensor"], adh, aw1t)
    # wgrad: dW1 = dh_col^T x_col, then dW2 = dy_col^T act_col (B given as the (tokens, n) view)
    adh_c = _expect_cols(wg1["a_tensor"], wg1["sfa_tensor"], dh, counts, rht, stochastic=sr)
    ax_c = _expect_cols(wg1["b_tensor"].t(), wg1["sfb_tensor"], x_pad, counts, rht)
    _check_alpha(wg1["global_scale_a"] * wg1["global_scale_b"], adh_c, ax_c)
    ady_c = _expect_cols(wg2["a_tensor"], wg2["sfa_tensor"], dy_pad, counts, rht, stochastic=sr)
    aact_c = _expect_cols(wg2["b_tensor"].t(), wg2["sfb_tensor"], act, counts, rht)
    _check_alpha(wg2["global_scale_a"] * wg2["global_scale_b"], ady_c, aact_c)
    if sr:  # every gradient copy of every non-empty expert was stochastically rounded
        assert len(SR_SEEN) == 4 * int((counts > 0).sum()) and min(SR_SEEN) > 0.05, SR_SEEN
    # rowwise and RHT'd columnwise copies have their own tensor scales
    if rht:
        assert not torch.equal(adh_c[counts > 0], adh[counts > 0])


def test_operand_check_catches_recipe_fields_ignored(monkeypatch):
    """The check above fails if weights ignore the 2D setting or the wgrad copies skip the RHT."""
    real_w, real_c = fp4.quantize_weights, fp4.quantize_columns
    with monkeypatch.context() as patch:
        patch.setattr(fp4, "quantize_weights", lambda w, block_2d: real_w(w, not block_2d))
        with pytest.raises(AssertionError):
            test_every_operand_of_a_run_is_our_quantizer_per_expert("default_no_sr")
    with monkeypatch.context() as patch:
        patch.setattr(fp4, "quantize_columns", lambda t, g, e, stochastic, rht: real_c(t, g, e, stochastic, False))
        with pytest.raises(AssertionError):
            test_every_operand_of_a_run_is_our_quantizer_per_expert("default_no_sr")


def test_cached_rht_is_the_quantizers_rht():
    g = torch.Generator().manual_seed(61)
    t = torch.randn(512, 40, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-9, 9, (512, 1), generator=g))
    for src in (t, t.float(), t.to(torch.bfloat16)):
        assert torch.equal(fp4.rht_along_rows(src), hadamard.apply_rht(src, axis=0))
