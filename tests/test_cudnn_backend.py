"""cuDNN backend on CPU: operand layouts, availability/supports, and the autograd glue.

No SM100 GPU is reachable from this project, so the kernels themselves are exercised only by
tests/gpu/test_cudnn_sm100.py (which skips below compute capability 10). Here:

* layouts: padded group offsets, the gate/up 32-column interleave, the 128x4 scale-factor atoms —
  each against an independent formula written in this file;
* availability / supports / ``auto`` with the GPU capability simulated by monkeypatching;
* the backend's forward/backward glue (padding, re-layouts, gradient assembly) run against
  ``DocumentedKernelEmulator``, a PyTorch stand-in that computes what cuDNN Frontend's docs say
  each wrapper computes, and that leaves every row it does not own as NaN. It is a stand-in for
  the kernels' documented contract, not a test of the kernels.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moe_reference import expert_mlp_fp64, random_problem, rel_err
from te_fused_moe.activations import ActivationConfig
from te_fused_moe.backends import ExpertMLPArgs, select_backend
from te_fused_moe.backends.cudnn import BACKEND, api, kernels, layouts
from te_fused_moe.quantize import mxfp8, nvfp4
from te_fused_moe.recipes import BF16Recipe, Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling

GEN = torch.Generator().manual_seed(20261202)


def _random_counts(experts, high=700):
    counts = torch.randint(0, high, (experts,), generator=GEN)
    counts[torch.rand(experts, generator=GEN) < 0.3] = 0  # some empty experts every time
    return counts


# --------------------------------------------------------------------------- padded groups

@pytest.mark.parametrize("experts", [1, 3, 8, 17])
def test_padded_offsets_match_a_python_loop(experts):
    for _ in range(5):
        counts = _random_counts(experts)
        expected, end = [], 0
        for c in counts.tolist():
            end += -(-c // 256) * 256
            expected.append(end)
        got = layouts.padded_offsets(counts)
        assert got.dtype == torch.int32 and got.tolist() == expected
        assert layouts.padded_offsets(counts.to(torch.int32)).tolist() == expected


@pytest.mark.parametrize("experts", [1, 4, 9])
def test_padded_row_index_places_each_row_in_its_groups_padded_block(experts):
    for padding in (0, 7):
        counts = _random_counts(experts, high=400)
        tokens = int(counts.sum()) + padding
        index = layouts.padded_row_index(counts, tokens).tolist()
        bound = layouts.padded_rows_bound(tokens, experts)
        expected, row, padded_start = [], 0, 0
        for c in counts.tolist():
            expected += [padded_start + i for i in range(c)]
            row += c
            padded_start += -(-c // 256) * 256
        assert padded_start <= bound and bound % 256 == 0
        expected += [bound - 1] * padding
        assert index == expected
        if padding:
            assert padded_start <= bound - 1  # the spare row is outside every group

        x = torch.randn(tokens, 5, generator=GEN)
        padded = layouts.scatter_to_padded(x, torch.tensor(index), bound)
        assert padded.shape == (bound, 5)
        routed = tokens - padding
        assert torch.equal(layouts.gather_from_padded(padded, torch.tensor(index))[:routed], x[:routed])
        assert layouts.valid_row_mask(counts, tokens).tolist() == [True] * routed + [False] * padding


def test_kernel_offsets_give_an_all_empty_routing_one_block():
    # cuDNN FE requires the last end offset in (0, M]; an all-empty routing becomes one zero block.
    assert kernels.kernel_offsets(torch.zeros(4, dtype=torch.int64)).tolist() == [0, 0, 0, 256]
    assert kernels.kernel_offsets(torch.tensor([0, 300, 0])).tolist() == [0, 512, 512]


# --------------------------------------------------------------------------- gate/up interleave

def test_interleave_round_trip_and_block_positions():
    e, f, h = 2, 96, 5
    w = torch.randn(e, 2 * f, h, generator=GEN)
    inter = layouts.interleave_glu(w, dim=1)
    assert torch.equal(layouts.deinterleave_glu(inter, dim=1), w)
    for i in range(2 * f):
        block, col = divmod(i, 32)
        half, pair = block % 2, block // 2  # even blocks gate, odd blocks up
        assert torch.equal(inter[:, i], w[:, half * f + pair * 32 + col])
    with pytest.raises(ValueError, match="multiple of 64"):
        layouts.interleave_glu(torch.zeros(3, 2 * 48), dim=1)


def _documented_glu(c, act, linear_offset=None):
    """cuDNN FE GLU epilogue on an interleaved C: 32-column pairs, even block gate, odd block up
    (kernel moe_grouped_gemm_glu_bias.py; TE's SwiGLU(glu_interleave_size=32) docs)."""
    out = []
    for b in range(c.shape[1] // 64):
        gate, up = c[:, 64 * b:64 * b + 32], c[:, 64 * b + 32:64 * b + 64]
        if act == "swiglu":
            out.append(up * gate * torch.sigmoid(gate))
        else:  # cuDNN "geglu" = GPT-OSS clamped SwiGLU
            g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            offset = 1.0 if linear_offset is None else linear_offset
            out.append((u + offset) * g * torch.sigmoid(1.702 * g))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("act", ["swiglu", "gpt_oss_swiglu"])
def test_interleaved_weights_feed_the_glu_epilogue_what_our_activation_expects(act):
    f, h = 64, 16
    x = torch.randn(11, h, generator=GEN, dtype=torch.float64) * 3
    w1 = torch.randn(2 * f, h, generator=GEN, dtype=torch.float64)
    b1 = torch.randn(2 * f, generator=GEN, dtype=torch.float64)
    ours = ActivationConfig(act).forward(x @ w1.T + b1)
    c = x @ layouts.interleave_glu(w1, dim=0).T + layouts.interleave_glu(b1, dim=0)
    assert torch.allclose(_documented_glu(c, "swiglu" if act == "swiglu" else "geglu"), ours, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- scale-factor atoms

def _atom_offset(l, r, c, row_tiles, col_tiles):
    """Byte offset of logical scale (l, r, c) in the 128x4 atom layout (cuBLAS block-scaling docs:
    128x4 tiles of 512 bytes, row-major over tiles; inside, offset (r%32)*16 + (r//32 % 4)*4 + c%4)."""
    tile = (l * row_tiles + r // 128) * col_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + (c % 4)


def _check_swizzle(scales_bytes):
    batch, rows, cols = scales_bytes.shape
    atoms = layouts.swizzle_scales(scales_bytes)
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    assert tuple(atoms.shape) == layouts.swizzled_scale_shape(rows, cols, batch)
    flat = atoms.reshape(-1)
    l, r, c = torch.meshgrid(torch.arange(batch), torch.arange(rows), torch.arange(cols), indexing="ij")
    offsets = _atom_offset(l, r, c, row_tiles, col_tiles).reshape(-1)
    assert torch.equal(flat[offsets], scales_bytes.reshape(-1))
    unused = torch.ones(flat.numel(), dtype=torch.bool)
    unused[offsets] = False
    assert bool((flat[unused] == 0).all())  # atom padding is zero-filled
    assert torch.equal(layouts.unswizzle_scales(atoms, rows, cols), scales_bytes)


@pytest.mark.parametrize("rows,k", [(130, 96), (256, 512), (7, 32)])
def test_mxfp8_scales_swizzle_to_the_atom_layout(rows, k):
    x = torch.randn(rows, k, generator=GEN) * torch.rand(rows, 1, generator=GEN) * 100
    q = mxfp8.quantize(x, axis=-1)
    assert q.scale.dtype == torch.uint8 and q.scale.shape == (rows, k // 32)
    _check_swizzle(q.scale.unsqueeze(0))
    # Dequantizing with scales read back through the atom layout gives the quantizer's own result.
    atoms = layouts.swizzle_scales(q.scale)
    back = layouts.unswizzle_scales(atoms, rows, k // 32)[0]
    deq = q.data.float() * torch.exp2(back.float() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(deq, mxfp8.dequantize(q))


@pytest.mark.parametrize("rows,k", [(200, 64), (128, 48)])
def test_nvfp4_scales_swizzle_to_the_atom_layout(rows, k):
    x = torch.randn(3, rows, k, generator=GEN)
    scales = torch.stack([nvfp4.quantize(x[i], axis=-1).scale for i in range(3)])
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (3, rows, k // 16)
    _check_swizzle(scales.view(torch.uint8))
    atoms = layouts.swizzle_scales(scales)  # float8 scales directly, same bytes
    assert atoms.dtype == torch.float8_e4m3fn
    assert torch.equal(atoms.view(torch.uint8), layouts.swizzle_scales(scales.view(torch.uint8)))


# --------------------------------------------------------------------------- availability, supports, auto

def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_hopper_is_refused_with_the_plain_reason(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0))
    verdict = BACKEND.availability(torch.device("cuda", 0))
    assert not verdict
    assert verdict.reason == (
        "cuDNN Frontend's fused grouped GEMM kernels need SM100+ (found sm_90); backend='auto' uses 'triton' on Hopper"
    )
    _fake_gpu(monkeypatch, (8, 0))
    assert BACKEND.availability(torch.device("cuda", 0)).reason.startswith(
        "cuDNN Frontend's fused grouped GEMM kernels need SM100+ (found sm_80)")
    assert "CUDA GPUs, not cpu" in BACKEND.availability(torch.device("cpu")).reason


def test_blackwell_without_cudnn_frontend_says_what_is_missing(monkeypatch):
    _fake_gpu(monkeypatch, (10, 0))
    monkeypatch.setattr(api, "load", lambda: (None, "nvidia-cudnn-frontend is not installed (pip install ...)"))
    verdict = BACKEND.availability(torch.device("cuda", 0))
    assert not verdict and "nvidia-cudnn-frontend is not installed" in verdict.reason


def test_auto_picks_triton_on_hopper(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0))
    chosen = select_backend("auto", torch.device("cuda", 0), ActivationConfig("swiglu"), BF16Recipe(), torch.bfloat16)
    assert chosen.name == "triton"
    with pytest.raises(RuntimeError, match=r"need SM100\+ \(found sm_90\)"):
        select_backend("cudnn", torch.device("cuda", 0), ActivationConfig("swiglu"), BF16Recipe(), torch.bfloat16)


def test_supports_matrix():
    bf16 = BF16Recipe()
    assert BACKEND.supports(ActivationConfig("swiglu"), bf16, torch.bfloat16)
    assert BACKEND.supports(ActivationConfig("gpt_oss_swiglu"), bf16, torch.bfloat16)
    for act in ("swiglu", "gpt_oss_swiglu", "srelu"):
        assert BACKEND.supports(ActivationConfig(act), MXFP8BlockScaling(), torch.bfloat16)
    for act in ("swiglu", "gpt_oss_swiglu"):  # NVFP4 cases: tests/test_cudnn_nvfp4.py
        assert BACKEND.supports(ActivationConfig(act), NVFP4BlockScaling(), torch.bfloat16)
    refused = [
        (ActivationConfig("geglu"), bf16, torch.bfloat16, "only for swiglu, gpt_oss_swiglu"),
        (ActivationConfig("silu"), bf16, torch.bfloat16, "only for swiglu, gpt_oss_swiglu"),
        (ActivationConfig("gelu"), bf16, torch.bfloat16, "only for swiglu, gpt_oss_swiglu"),
        (ActivationConfig("srelu"), bf16, torch.bfloat16, "take only block-scaled"),
        (ActivationConfig("gpt_oss_swiglu", limit=10.0), bf16, torch.bfloat16, "GLU kernels alpha=1.702, limit=7.0 only"),
        (ActivationConfig("swiglu"), Float8BlockScaling(), torch.bfloat16, "not 128-element FP8 blocks"),
        (ActivationConfig("swiglu"), MXFP8BlockScaling(fp8_format=Format.HYBRID), torch.bfloat16, "of one FP8 dtype"),
        (ActivationConfig("srelu"), NVFP4BlockScaling(), torch.bfloat16, "swiglu and gpt_oss_swiglu only"),
        (ActivationConfig("swiglu"), NVFP4BlockScaling(), torch.float16, "take bfloat16 parameters"),
        (ActivationConfig("swiglu"), bf16, torch.float16, "take bfloat16 parameters"),
    ]
    for act, recipe, dtype, why in refused:
        verdict = BACKEND.supports(act, recipe, dtype)
        assert not verdict and why in verdict.reason, (act, recipe, verdict)


def test_signature_check_names_the_missing_parameter():
    def entry(*names):
        params = ", ".join(names)
        namespace = {}
        exec(f"def f({params}): pass", namespace)  # a function with exactly these parameters
        return namespace["f"]

    full = {name: entry(*params) for name, params in api.REQUIRED_PARAMETERS.items()}
    classes = {name: type(name, (), {}) for name in api.REQUIRED_CLASSES}
    assert api.check_signatures(SimpleNamespace(**full, **classes)) == (True, "")
    params = [p for p in api.REQUIRED_PARAMETERS["grouped_gemm_dglu_wrapper_sm100"] if p != "dprob_tensor"]
    broken = dict(full, grouped_gemm_dglu_wrapper_sm100=entry(*params))
    ok, reason = api.check_signatures(SimpleNamespace(**broken, **classes))
    assert not ok and "grouped_gemm_dglu_wrapper_sm100 lacks parameter(s) ['dprob_tensor']" in reason
    ok, reason = api.check_signatures(SimpleNamespace(**full))
    assert not ok and "GroupedGemmGluSm100 is missing" in reason


def test_shape_limits_are_explained():
    args = ExpertMLPArgs(x=torch.zeros(4, 16), tokens_per_expert=torch.tensor([4]), w1=torch.zeros(1, 96, 16),
                         w2=torch.zeros(1, 16, 48), activation=ActivationConfig("swiglu"), recipe=BF16Recipe())
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.check_shapes(args)
    args.w1, args.w2, args.x = torch.zeros(1, 64, 12), torch.zeros(1, 12, 32), torch.zeros(4, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.check_shapes(args)


# --------------------------------------------------------------------------- the glue, on the documented contract

def _documented_dglu_rows(c, r, prob, act_func, linear_offset, beta):
    """grouped_gemm_dglu.md on one group's rows: ``c`` the interleaved pre-activation, ``r`` = dy @ W2
    (the GEMM part). Returns (d(pre-activation) interleaved, dprob per row)."""
    blocks, dprob = [], 0
    for b in range(c.shape[1] // 64):
        raw_gate, raw_up = c[:, 64 * b:64 * b + 32], c[:, 64 * b + 32:64 * b + 64]
        rb = r[:, 32 * b:32 * b + 32]
        if act_func == "dswiglu":
            gate, up = beta * raw_gate, beta * raw_up
            sig = torch.sigmoid(gate)
            dgate = rb * prob * up * sig * (1 + gate * (1 - sig))
            dup = rb * prob * gate * sig
            dprob = dprob + (rb * up * gate * sig).sum(dim=1)
        else:  # dgeglu with the documented default alpha and clamp bounds
            gate, up = raw_gate.clamp(max=7.0), raw_up.clamp(-7.0, 7.0)
            sig = torch.sigmoid(1.702 * gate)
            dgate = rb * prob * (up + linear_offset) * sig * (1 + 1.702 * gate * (1 - sig)) * (raw_gate <= 7.0)
            dup = rb * prob * gate * sig * ((raw_up >= -7.0) & (raw_up <= 7.0))
            dprob = dprob + (rb * gate * sig * (up + linear_offset)).sum(dim=1)
        blocks += [dgate, dup]
    return torch.cat(blocks, dim=1), dprob


class DocumentedKernelEmulator:
    """What cuDNN Frontend 1.32's docs say each grouped wrapper computes (grouped_gemm_glu.md,
    grouped_gemm_dglu.md, grouped_gemm.md, grouped_gemm_wgrad.md), in plain PyTorch. Reads the
    offsets on the host (tests only). Rows outside every group are left NaN, as unwritten memory."""

    calls = None

    def __init__(self):
        self.calls = []

    @staticmethod
    def _groups(offsets):
        start = 0
        for g, end in enumerate(offsets.tolist()):
            yield g, start, end
            start = end

    @staticmethod
    def _nan(rows, cols, dtype):
        return torch.full((rows, cols), float("nan"), dtype=dtype)

    def grouped_gemm_glu_wrapper_sm100(self, *, a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor,
                                       bias_tensor, prob_tensor, c_dtype, d_dtype, act_func, linear_offset,
                                       m_aligned, generate_c):
        self.calls.append("glu")
        assert sfa_tensor is None and m_aligned == 256 and generate_c and padded_offsets.dtype == torch.int32
        assert bias_tensor is None or bias_tensor.stride() == (1, bias_tensor.shape[0])  # (N, L), stride (1, N)
        m, n = a_tensor.shape[0], b_tensor.shape[1]
        c, d = self._nan(m, n, c_dtype), self._nan(m, n // 2, d_dtype)
        for g, s, e in self._groups(padded_offsets):
            acc = alpha_tensor[g] * (a_tensor[s:e] @ b_tensor[g].T)
            if bias_tensor is not None:
                acc = acc + bias_tensor[:, g]
            c[s:e] = acc
            if act_func == "swiglu":
                assert linear_offset == 0.0
            d[s:e] = prob_tensor[s:e, None] * _documented_glu(acc, act_func, linear_offset)
        return {"c_tensor": c, "d_tensor": d}

    def grouped_gemm_wrapper_sm100(self, *, a_tensor, padded_offsets, alpha_tensor, b_tensor, c_dtype, d_dtype,
                                   m_aligned, bias_tensor=None):
        self.calls.append("gemm")
        m, n = a_tensor.shape[0], b_tensor.shape[1]
        d = self._nan(m, n, d_dtype)
        for g, s, e in self._groups(padded_offsets):
            d[s:e] = alpha_tensor[g] * (a_tensor[s:e] @ b_tensor[g].T)
            if bias_tensor is not None:
                d[s:e] += bias_tensor[:, g]
        return {"d_tensor": d}

    def grouped_gemm_dglu_wrapper_sm100(self, *, a_tensor, c_tensor, sfa_tensor, padded_offsets, alpha_tensor,
                                        beta_tensor, prob_tensor, dprob_tensor, b_tensor, generate_dbias, d_dtype,
                                        act_func, linear_offset, deterministic):
        self.calls.append("dglu")
        assert bool((dprob_tensor == 0).all()), "dprob must be zero-initialised"
        m, n2 = c_tensor.shape
        d_row = self._nan(m, n2, d_dtype)
        dbias = torch.zeros(b_tensor.shape[0], n2, 1, dtype=d_dtype) if generate_dbias else None
        for g, s, e in self._groups(padded_offsets):
            ref = alpha_tensor[g] ** 2 * (a_tensor[s:e] @ b_tensor[g].T)  # [rows, N]
            rows_dh, rows_dprob = _documented_dglu_rows(c_tensor[s:e], ref, prob_tensor[s:e, None], act_func,
                                                        linear_offset, beta_tensor[g])
            dprob_tensor[s:e] += rows_dprob
            d_row[s:e] = rows_dh
            if generate_dbias:
                dbias[g, :, 0] = d_row[s:e].sum(dim=0)
        return {"d_row_tensor": d_row, "dprob_tensor": dprob_tensor, "dbias_tensor": dbias}

    def grouped_gemm_wgrad_wrapper_sm100(self, *, a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor,
                                         wgrad_dtype):
        self.calls.append("wgrad")
        assert a_tensor.stride() == (1, a_tensor.shape[0])  # A (hidden, tokens) given M-major
        # torch.empty in the wrapper: a group with no rows is never written (NaN here)
        out = torch.full((offsets_tensor.shape[0], a_tensor.shape[0], b_tensor.shape[1]), float("nan"),
                         dtype=wgrad_dtype)
        for g, s, e in self._groups(offsets_tensor):
            if e > s:
                out[g] = a_tensor[:, s:e] @ b_tensor[s:e]
        return {"wgrad_tensor": out}


@pytest.mark.parametrize("activation,bias,probs,routing,padding", [
    ("swiglu", False, False, "balanced", 0),
    ("swiglu", True, True, "empty", 5),
    ("gpt_oss_swiglu", True, True, "zipf", 3),
])
def test_glue_on_documented_contract_matches_fp64(activation, bias, probs, routing, padding):
    problem = random_problem(T=60, H=16, F=64, E=3, activation=activation, dtype=torch.float64, bias=bias,
                             probs=probs, routing=routing, padding=padding, scale=4.0)  # scale reaches the clamp
    leaves = {k: (v.clone().requires_grad_(True) if k in ("x", "w1", "w2", "b1", "b2", "probs") and v is not None
                  else v) for k, v in problem.items()}
    args = ExpertMLPArgs(x=leaves["x"], tokens_per_expert=leaves["tokens_per_expert"], w1=leaves["w1"],
                         w2=leaves["w2"], activation=ActivationConfig(activation), recipe=BF16Recipe(),
                         b1=leaves["b1"], b2=leaves["b2"], probs=leaves["probs"])
    fe = DocumentedKernelEmulator()
    y = kernels.run_expert_mlp(fe, args)
    dy = torch.randn(y.shape, generator=GEN, dtype=torch.float64)
    y.backward(dy)
    assert fe.calls == ["glu", "gemm", "dglu", "gemm", "wgrad", "wgrad"]

    ref = expert_mlp_fp64(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"], activation,
                          b1=problem["b1"], b2=problem["b2"], probs=problem["probs"], dy=dy)
    assert rel_err(y, ref["y"]) < 1e-12
    for name in ("x", "w1", "w2") + (("b1", "b2") if bias else ()):
        assert rel_err(leaves[name].grad, ref[name]) < 1e-11, name
    if probs:  # dprob is an FP32 buffer by the kernel's contract
        assert rel_err(leaves["probs"].grad, ref["probs"]) < 1e-6
    if padding:
        assert bool((y[-padding:] == 0).all()) and bool((leaves["x"].grad[-padding:] == 0).all())


def test_glue_with_every_expert_empty_gives_zeros():
    problem = random_problem(T=9, H=8, F=32, E=2, dtype=torch.float64, bias=True, padding=9)
    x = problem["x"].clone().requires_grad_(True)
    w1 = problem["w1"].clone().requires_grad_(True)
    args = ExpertMLPArgs(x=x, tokens_per_expert=problem["tokens_per_expert"], w1=w1, w2=problem["w2"],
                         activation=ActivationConfig("swiglu"), recipe=BF16Recipe(), b1=problem["b1"], b2=problem["b2"])
    y = kernels.run_expert_mlp(DocumentedKernelEmulator(), args)
    y.sum().backward()
    assert bool((y == 0).all()) and bool((x.grad == 0).all()) and bool((w1.grad == 0).all())
    assert not math.isnan(float(w1.grad.sum()))


def test_deterministic_with_prob_gradients_is_refused():
    problem = random_problem(T=20, H=8, F=32, E=2, dtype=torch.float64, probs=True)
    args = ExpertMLPArgs(x=problem["x"], tokens_per_expert=problem["tokens_per_expert"], w1=problem["w1"],
                         w2=problem["w2"], activation=ActivationConfig("swiglu"), recipe=BF16Recipe(),
                         probs=problem["probs"].requires_grad_(True), deterministic=True)
    with pytest.raises(ValueError, match="deterministic: .*atomics"):
        kernels.run_expert_mlp(DocumentedKernelEmulator(), args)
    args.probs = problem["probs"].detach()  # without a prob gradient every output is atomics-free
    y = kernels.run_expert_mlp(DocumentedKernelEmulator(), args)
    ref = expert_mlp_fp64(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"], probs=args.probs)
    assert rel_err(y, ref["y"]) < 1e-12


# --------------------------------------------------------------------------- MXFP8 glue, on the block-scaled contract

E8M0_NAN = 255


def _read_atoms(atoms, batch, rows, cols):
    """Scale codes [batch, rows, cols] read from an atom buffer through ``_atom_offset`` (written
    here from the cuBLAS 128x4 layout, independent of layouts.py)."""
    flat = atoms.contiguous().view(torch.uint8).reshape(-1)
    l, r, c = torch.meshgrid(torch.arange(batch), torch.arange(rows), torch.arange(cols), indexing="ij")
    return flat[_atom_offset(l, r, c, -(-rows // 128), -(-cols // 4))]


def _write_atoms(codes):
    """[batch, rows, cols] uint8 codes -> atom buffer (padding 0), via ``_atom_offset``."""
    batch, rows, cols = codes.shape
    rt, ct = -(-rows // 128), -(-cols // 4)
    flat = torch.zeros(batch * rt * ct * 512, dtype=torch.uint8)
    l, r, c = torch.meshgrid(torch.arange(batch), torch.arange(rows), torch.arange(cols), indexing="ij")
    flat[_atom_offset(l, r, c, rt, ct)] = codes
    return flat.view(batch, rt, ct, 32, 4, 4).view(torch.float8_e8m0fnu)


def _read_atom_view(view, batch, rows, cols):
    """Scale codes from the older wrappers' ``(32, 4, MN/128, 4, K/4, L)`` view: element (l, r, c)
    at ``[r % 32, (r // 32) % 4, r // 128, c % 4, c // 4, l]`` (its documented mode order)."""
    assert view.dim() == 6 and tuple(view.shape[:2]) == (32, 4) and view.shape[3] == 4 and view.shape[5] == batch
    codes = view.view(torch.uint8) if view.dtype != torch.uint8 else view
    l, r, c = torch.meshgrid(torch.arange(batch), torch.arange(rows), torch.arange(cols), indexing="ij")
    return codes[r % 32, (r // 32) % 4, r // 128, c % 4, c // 4, l]


def _write_atom_view(codes):
    """[1, rows, cols] codes -> a fresh ``(32, 4, MN/128, 4, K/4, 1)`` view, written by the same rule."""
    _, rows, cols = codes.shape
    view = torch.zeros(32, 4, -(-rows // 128), 4, -(-cols // 4), 1, dtype=torch.uint8)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    view[r % 32, (r // 32) % 4, r // 128, c % 4, c // 4, 0] = codes[0]
    return view.view(torch.float8_e8m0fnu)


def _from_legacy_rows(t):
    assert t.dim() == 3 and t.shape[2] == 1 and t.stride()[:2] == (t.shape[1], 1), (t.shape, t.stride())
    return t[:, :, 0]


def _from_legacy_weights(b):
    n, k, l = b.shape
    assert b.stride() == (k, 1, n * k), b.stride()  # K-major (N, K, L)
    return b.permute(2, 0, 1)


def _from_legacy_vector(v):
    assert v.dim() == 3 and tuple(v.shape[1:]) == (1, 1) and v.stride(0) == 1
    return v[:, 0, 0]  # a view: in-place updates reach the caller's buffer


def _mx_dequant(data, atoms, along_rows=False):
    """FP64 values of an MXFP8 operand: ``data [..., R, C]`` E4M3 with one E8M0 scale per 32 along C
    (or along R for ``along_rows``, scales stored as the transposed logical matrix)."""
    vals = data.to(torch.float64)
    if vals.dim() == 2:
        vals = vals.unsqueeze(0)
    if along_rows:
        vals = vals.transpose(1, 2)
    batch, rows, cols = vals.shape
    read = _read_atoms if atoms.dim() == 6 and tuple(atoms.shape[3:]) == (32, 4, 4) else _read_atom_view
    codes = read(atoms, batch, rows, cols // 32).to(torch.float64)
    # Code 255 (E8M0 NaN, the emulator's poison for unwritten scales) dequantizes to NaN, so a group
    # row that reads one poisons the result.
    scales = torch.where(codes == E8M0_NAN, float("nan"), torch.exp2(codes - 127)).repeat_interleave(32, dim=2)
    out = vals * scales
    if along_rows:
        out = out.transpose(1, 2)
    return out.squeeze(0) if data.dim() == 2 else out


def _mx_quantize_doc(v, along_rows=False):
    """The epilogue's documented MXFP8 output rule on FP32 accumulators: scale = 2^ceil(log2(amax/448)),
    value = RNE_E4M3(v / scale). Returns (E4M3 data, codes [rows, cols/32] or [cols, rows/32])."""
    v = v.float().double()
    t = v.t() if along_rows else v
    blocks = t.reshape(t.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2)
    code = torch.where(amax > 0, torch.ceil(torch.log2(amax / 448.0)) + 127, torch.zeros_like(amax)).clamp(0, 254)
    q = (blocks / torch.exp2(code - 127)[..., None]).reshape(t.shape).to(torch.float8_e4m3fn)
    return (q.t() if along_rows else q), code.to(torch.uint8)


class DocumentedBlockScaledEmulator(DocumentedKernelEmulator):
    """The block-scaled (MXFP8, sf_vec_size 32) contract of the same wrappers plus
    grouped_gemm_quant / srelu / dsrelu: operands arrive as E4M3 data + E8M0 scales in 128x4 atoms;
    this class un-swizzles and dequantizes them itself and computes in FP64. FP8 outputs (D, D_col,
    d_row, d_col) are quantized by the documented epilogue rule with norm_const = 1; rows outside
    every group are NaN and their scales the E8M0 NaN code."""

    def _quantized_outputs(self, values, offsets, prefix, legacy=False):
        m, n = values.shape
        row = torch.full((m, n), float("nan"), dtype=torch.float64).to(torch.float8_e4m3fn)
        col = row.clone()
        sf_row = torch.full((m, n // 32), E8M0_NAN, dtype=torch.uint8)
        sf_col = torch.full((n, m // 32), E8M0_NAN, dtype=torch.uint8)
        for _, s, e in self._groups(offsets):
            if e == s:
                continue
            row[s:e], sf_row[s:e] = _mx_quantize_doc(values[s:e])
            col[s:e], sf_col[:, s // 32:e // 32] = _mx_quantize_doc(values[s:e], along_rows=True)
        write = _write_atom_view if legacy else _write_atoms  # the older wrappers return the atom view
        if legacy:
            row, col = row.unsqueeze(-1), col.unsqueeze(-1)
        return {f"{prefix}_tensor": row, "d_col_tensor": col,
                "sfd_row_tensor": write(sf_row[None]), "sfd_col_tensor": write(sf_col[None])}

    def _fc1(self, kind, a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor, sfb_tensor, bias_tensor,
             prob_tensor, norm_const_tensor, c_dtype, d_dtype, sf_vec_size, m_aligned, act=None, linear_offset=None):
        self.calls.append(kind)
        assert sf_vec_size == 32 and m_aligned == 256 and d_dtype == torch.float8_e4m3fn
        assert norm_const_tensor.tolist() == [1.0] and padded_offsets.dtype == torch.int32
        legacy = kind == "srelu"  # grouped_gemm_srelu takes (M, K, 1) A, (N, K, L) B, (M, 1, 1) prob
        if legacy:
            a_tensor, b_tensor = _from_legacy_rows(a_tensor), _from_legacy_weights(b_tensor)
            prob_tensor = _from_legacy_vector(prob_tensor)
        a, b = _mx_dequant(a_tensor, sfa_tensor), _mx_dequant(b_tensor, sfb_tensor)
        m, n = a.shape[0], b.shape[1]
        c = self._nan(m, n, c_dtype)
        d = self._nan(m, n // 2 if kind == "glu" else n, torch.float64)
        for g, s, e in self._groups(padded_offsets):
            acc = alpha_tensor[g] * (a[s:e] @ b[g].T)
            if bias_tensor is not None:
                acc = acc + bias_tensor[:, g]
            c[s:e] = acc
            act_out = _documented_glu(acc, act, linear_offset) if kind == "glu" else torch.relu(acc) ** 2
            d[s:e] = prob_tensor[s:e, None] * act_out
        if legacy:
            c = c.unsqueeze(-1)
        return dict(c_tensor=c, **self._quantized_outputs(d, padded_offsets, "d", legacy))

    def grouped_gemm_glu_wrapper_sm100(self, *, act_func, linear_offset, generate_c, **kw):
        if kw["sfa_tensor"] is None:
            return super().grouped_gemm_glu_wrapper_sm100(act_func=act_func, linear_offset=linear_offset,
                                                          generate_c=generate_c, **kw)
        assert generate_c
        return self._fc1("glu", act=act_func, linear_offset=linear_offset, **kw)

    def grouped_gemm_srelu_wrapper_sm100(self, **kw):
        return self._fc1("srelu", **kw)

    def grouped_gemm_quant_wrapper_sm100(self, *, a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor,
                                         sfb_tensor, norm_const_tensor, d_dtype, sf_vec_size, m_aligned,
                                         generate_amax, bias_tensor=None):
        self.calls.append("quant_gemm")
        assert sf_vec_size == 32 and m_aligned == 256
        a, b = _mx_dequant(a_tensor, sfa_tensor), _mx_dequant(b_tensor, sfb_tensor)
        d = self._nan(a.shape[0], b.shape[1], d_dtype)
        for g, s, e in self._groups(padded_offsets):
            d[s:e] = alpha_tensor[g] * (a[s:e] @ b[g].T) + (bias_tensor[:, g] if bias_tensor is not None else 0)
        return {"d_tensor": d}

    def _dact(self, kind, a_tensor, c_tensor, sfa_tensor, padded_offsets, alpha_tensor, prob_tensor, dprob_tensor,
              b_tensor, sfb_tensor, generate_dbias, norm_const_tensor, d_dtype, sf_vec_size, m_aligned,
              deterministic, beta_tensor=None, act_func=None, linear_offset=None):
        self.calls.append(kind)
        assert bool((dprob_tensor == 0).all()), "dprob must be zero-initialised"
        assert sf_vec_size == 32 and d_dtype == torch.float8_e4m3fn and norm_const_tensor.tolist() == [1.0]
        legacy = kind == "dsrelu"
        if legacy:
            a_tensor, b_tensor, c_tensor = (_from_legacy_rows(a_tensor), _from_legacy_weights(b_tensor),
                                            _from_legacy_rows(c_tensor))
            prob_tensor, dprob_tensor = _from_legacy_vector(prob_tensor), _from_legacy_vector(dprob_tensor)
        a, b = _mx_dequant(a_tensor, sfa_tensor), _mx_dequant(b_tensor, sfb_tensor)
        m, n = c_tensor.shape
        dh = self._nan(m, n, torch.float64)
        dbias = torch.zeros(b.shape[0], n, 1, dtype=torch.float64) if generate_dbias else None
        for g, s, e in self._groups(padded_offsets):
            # dGLU scales by alpha^2 (square_alpha, moe_blockscaled_grouped_gemm_dglu_dbias.py), dsReLU by alpha
            r = (alpha_tensor[g] ** 2 if kind == "dglu" else alpha_tensor[g]) * (a[s:e] @ b[g].T)
            prob, c = prob_tensor[s:e, None], c_tensor[s:e]
            if kind == "dglu":
                dh[s:e], dprob = _documented_dglu_rows(c, r, prob, act_func, linear_offset, beta_tensor[g])
            else:  # grouped_gemm_dsrelu.md: d = dy_ref * prob * 2 relu(c); dprob = sum(dy_ref * relu(c)^2)
                dh[s:e], dprob = r * prob * 2 * torch.relu(c), (r * torch.relu(c) ** 2).sum(dim=1)
            dprob_tensor[s:e] += dprob
            if generate_dbias:
                dbias[g, :, 0] = dh[s:e].sum(dim=0)
        out = self._quantized_outputs(dh, padded_offsets, "d_row", legacy)
        return dict(out, dprob_tensor=dprob_tensor.reshape(-1, 1, 1) if legacy else dprob_tensor,
                    dbias_tensor=dbias)

    def grouped_gemm_dglu_wrapper_sm100(self, **kw):
        if kw["sfa_tensor"] is None:
            return super().grouped_gemm_dglu_wrapper_sm100(**kw)
        return self._dact("dglu", **kw)

    def grouped_gemm_dsrelu_wrapper_sm100(self, **kw):
        return self._dact("dsrelu", **kw)

    def grouped_gemm_wgrad_wrapper_sm100(self, *, a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor,
                                         wgrad_dtype, sf_vec_size=None):
        if sfa_tensor is None:
            return super().grouped_gemm_wgrad_wrapper_sm100(a_tensor=a_tensor, b_tensor=b_tensor, sfa_tensor=None,
                                                            sfb_tensor=None, offsets_tensor=offsets_tensor,
                                                            wgrad_dtype=wgrad_dtype)
        self.calls.append("wgrad")
        assert sf_vec_size == 32
        a = _mx_dequant(a_tensor, sfa_tensor)  # (m, tokens), scales over (m, tokens/32)
        b = _mx_dequant(b_tensor, sfb_tensor, along_rows=True)  # (tokens, n), scales over (n, tokens/32)
        out = torch.full((offsets_tensor.shape[0], a.shape[0], b.shape[1]), float("nan"), dtype=wgrad_dtype)
        for g, s, e in self._groups(offsets_tensor):
            if e > s:
                out[g] = a[:, s:e] @ b[s:e]
        return {"wgrad_tensor": out}


def _run_mxfp8(activation, bias, probs, routing, padding, fe=None, deterministic=False):
    from fake_quant_reference import quantized_expert_mlp_fp64

    recipe = MXFP8BlockScaling()
    problem = random_problem(T=70, H=64, F=64, E=3, activation=activation, dtype=torch.float64, bias=bias,
                             probs=probs, routing=routing, padding=padding, scale=4.0)
    leaves = {k: (v.clone().requires_grad_(True) if k in ("x", "w1", "w2", "b1", "b2", "probs") and v is not None
                  else v) for k, v in problem.items()}
    args = ExpertMLPArgs(x=leaves["x"], tokens_per_expert=leaves["tokens_per_expert"], w1=leaves["w1"],
                         w2=leaves["w2"], activation=ActivationConfig(activation), recipe=recipe,
                         b1=leaves["b1"], b2=leaves["b2"], probs=leaves["probs"], deterministic=deterministic)
    fe = fe or DocumentedBlockScaledEmulator()
    y = kernels.run_expert_mlp(fe, args)
    dy = torch.randn(y.shape, generator=GEN, dtype=torch.float64)
    y.backward(dy)
    ref = quantized_expert_mlp_fp64(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"], recipe,
                                    activation, b1=problem["b1"], b2=problem["b2"], probs=problem["probs"], dy=dy)
    errors = {"y": rel_err(y, ref["y"])}
    unquantized = expert_mlp_fp64(problem["x"], problem["tokens_per_expert"], problem["w1"], problem["w2"], activation,
                                  b1=problem["b1"], b2=problem["b2"], probs=problem["probs"])
    errors["vs_unquantized_y"] = rel_err(y, unquantized["y"])  # must be large: MXFP8 rounding is really applied
    for name in ("x", "w1", "w2", "b1", "b2", "probs"):
        if leaves[name] is not None:
            errors[name] = rel_err(leaves[name].grad, ref[name])
    return fe, errors, y, leaves


@pytest.mark.parametrize("activation,bias,probs,routing,padding", [
    ("swiglu", True, True, "balanced", 4),
    ("gpt_oss_swiglu", False, True, "empty", 0),
    ("srelu", True, True, "zipf", 3),
])
def test_mxfp8_glue_on_documented_contract_matches_fake_quantized_fp64(activation, bias, probs, routing, padding):
    fe, errors, y, leaves = _run_mxfp8(activation, bias, probs, routing, padding)
    fc1, dact = ("srelu", "dsrelu") if activation == "srelu" else ("glu", "dglu")
    assert fe.calls == [fc1, "quant_gemm", dact, "quant_gemm", "wgrad", "wgrad"]
    assert errors.pop("vs_unquantized_y") > 1e-3, errors
    for name, err in errors.items():  # same quantized operands, FP64 on both sides; dprob is an FP32 buffer
        assert err < (1e-6 if name == "probs" else 1e-10), (name, errors)
    if padding:
        assert bool((y[-padding:] == 0).all()) and bool((leaves["x"].grad[-padding:] == 0).all())


def test_mxfp8_mutations_are_caught(monkeypatch):
    """A wrong scale swizzle, or a wgrad operand quantized along the wrong axis, must fail the check above."""
    from te_fused_moe.backends.cudnn import blockscaled

    def naive_swizzle(scales, fill=None):  # row-major tiles, no 32x4 interleave inside the atom
        s = scales if scales.dim() == 3 else scales.unsqueeze(0)
        padded = torch.zeros(s.shape[0], -(-s.shape[1] // 128) * 128, -(-s.shape[2] // 4) * 4, dtype=s.dtype)
        padded[:, :s.shape[1], :s.shape[2]] = s
        return padded.reshape(s.shape[0], padded.shape[1] // 128, padded.shape[2] // 4, 32, 4, 4)

    with monkeypatch.context() as patch:
        patch.setattr(blockscaled, "swizzle_scales", naive_swizzle)
        _, errors, _, _ = _run_mxfp8("swiglu", False, False, "balanced", 0)
        assert errors["y"] > 1e-2, errors

    def wrong_axis_columnwise(t):  # rowwise data/scales where the wgrad needs columnwise ones
        q = mxfp8.quantize(t, axis=0, fp8_format="e4m3")
        wrong = mxfp8.quantize(t, axis=1, fp8_format="e4m3")
        return wrong.data, layouts.swizzle_scales(q.scale.t()).view(torch.float8_e8m0fnu)

    with monkeypatch.context() as patch:
        patch.setattr(blockscaled, "mx_columnwise", wrong_axis_columnwise)
        _, errors, _, _ = _run_mxfp8("swiglu", False, False, "balanced", 0)
        assert errors["y"] < 1e-10 and errors["w1"] > 1e-3 and errors["w2"] > 1e-3, errors


def test_mxfp8_refusals_name_the_kernel_limit():
    problem = random_problem(T=40, H=32, F=32, E=2, dtype=torch.float64, bias=True, probs=True)
    base = dict(x=problem["x"], tokens_per_expert=problem["tokens_per_expert"], w1=problem["w1"], w2=problem["w2"],
                probs=problem["probs"], b2=problem["b2"])
    args = ExpertMLPArgs(**base, activation=ActivationConfig("swiglu"), recipe=MXFP8BlockScaling(),
                         b1=problem["b1"].clone().requires_grad_(True), deterministic=True)
    with pytest.raises(ValueError, match="deterministic: .*excludes the fused dbias"):
        kernels.run_expert_mlp(DocumentedBlockScaledEmulator(), args)
    args = ExpertMLPArgs(**base, activation=ActivationConfig("srelu"), recipe=BF16Recipe(), b1=problem["b1"])
    with pytest.raises(ValueError, match="squared-ReLU kernels take only block-scaled"):
        kernels.run_expert_mlp(DocumentedBlockScaledEmulator(), args)
    args = ExpertMLPArgs(**dict(base, x=problem["x"][:, :16].contiguous(), w1=problem["w1"][:, :, :16].contiguous(),
                                w2=problem["w2"][:, :16].contiguous(), b2=problem["b2"][:, :16].contiguous()),
                         activation=ActivationConfig("swiglu"), recipe=MXFP8BlockScaling())
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.run_expert_mlp(DocumentedBlockScaledEmulator(), args)


def test_documented_epilogue_rule_is_our_mxfp8_quantizer():
    """The emulator's epilogue rule (scale 2^ceil(log2(amax/448)), RNE E4M3) gives exactly our
    TE-rule quantizer's bytes, including blocks whose amax/448 is an exact power of two."""
    v = torch.randn(64, 96, generator=GEN) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=GEN).float())
    v[3, :32] = 448.0 * 2.0 ** -3  # amax/448 exactly a power of two
    v[5, 32:64] = 0.0  # all-zero block
    for along_rows in (False, True):
        data, codes = _mx_quantize_doc(v.double(), along_rows=along_rows)
        q = mxfp8.quantize(v, axis=0 if along_rows else 1)
        assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(codes, q.scale.t() if along_rows else q.scale)
