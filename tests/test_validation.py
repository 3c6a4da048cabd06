"""Every check of te_fused_moe.fused_moe_mlp: the exception type and a message naming the argument.

BAD_INPUTS below is the table of docs/bad_inputs.md; a test keeps the two in step.
"""

import pathlib
import re

import pytest
import torch

import te_fused_moe
from te_fused_moe import ActivationConfig
from te_fused_moe.backends import Availability, get_backend

T, H, F, E = 10, 16, 16, 2
ROUTED = 8  # two padding rows


def good_inputs(dtype=torch.float32):
    """Valid arguments for the reference backend (random, never zeros)."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    return dict(
        x=rand(T, H),
        tokens_per_expert=torch.tensor([5, 3]),
        w1=rand(E, 2 * F, H) / 4,
        w2=rand(E, H, F) / 4,
        activation="swiglu",
        b1=rand(E, 2 * F),
        b2=rand(E, H),
        probs=torch.rand(T, generator=g) + 0.1,
        backend="reference",
    )


def call(**overrides):
    kwargs = good_inputs()
    kwargs.update(overrides)
    x, counts, w1, w2 = (kwargs.pop(k) for k in ("x", "tokens_per_expert", "w1", "w2"))
    return te_fused_moe.fused_moe_mlp(x, counts, w1, w2, **kwargs)


def _non_contiguous(shape):
    return torch.randn(*reversed(shape)).transpose(0, -1) if len(shape) > 1 else torch.randn(2 * shape[0])[::2]


META = "meta"

# id -> (overrides, exception, substrings the message must contain). Mirrors docs/bad_inputs.md.
BAD_INPUTS = {
    "x-not-tensor": (dict(x=[[1.0] * H] * T), TypeError, ["x:", "torch.Tensor", "list"]),
    "x-ndim": (dict(x=torch.randn(T, H, 1)), ValueError, ["x:", "[T, H]", "(10, 16, 1)"]),
    "x-int-dtype": (dict(x=torch.ones(T, H, dtype=torch.int32)), TypeError, ["x:", "floating dtype", "torch.int32"]),
    "x-non-contiguous": (dict(x=_non_contiguous((T, H))), ValueError, ["x:", "contiguous"]),
    "x-zero-hidden": (dict(x=torch.randn(T, 0)), ValueError, ["x:", "H >= 1", "(10, 0)"]),
    "w2-ndim": (dict(w2=torch.randn(H, F)), ValueError, ["w2:", "[E, H, F]"]),
    "w2-no-experts": (dict(w2=torch.randn(0, H, F)), ValueError, ["w2:", "E >= 1", "(0, 16, 16)"]),
    "w2-zero-ffn": (dict(w2=torch.randn(E, H, 0)), ValueError, ["w2:", "F >= 1", "(2, 16, 0)"]),
    "w2-not-tensor": (dict(w2=None), TypeError, ["w2:", "torch.Tensor", "NoneType"]),
    "w2-hidden": (dict(w2=torch.randn(E, H + 16, F), w1=torch.randn(E, 2 * F, H)), ValueError,
                  ["w2:", "H=16", "(2, 32, 16)"]),
    "w1-ndim": (dict(w1=torch.randn(2 * F, H)), ValueError, ["w1:", "[E, 2F, H]"]),
    "w1-not-gated-width": (dict(w1=torch.randn(E, F, H)), ValueError, ["w1:", "(2, 32, 16)", "gated", "swiglu"]),
    "w1-gated-width-for-srelu": (dict(w1=torch.randn(E, 2 * F, H), activation="srelu", b1=None), ValueError,
                                 ["w1:", "(2, 16, 16)", "srelu"]),
    "w1-experts": (dict(w1=torch.randn(E + 1, 2 * F, H)), ValueError, ["w1:", "(2, 32, 16)", "(3, 32, 16)"]),
    "w1-dtype": (dict(w1=torch.randn(E, 2 * F, H, dtype=torch.float64)), TypeError, ["w1:", "float32", "float64"]),
    "w2-dtype": (dict(w2=torch.randn(E, H, F).bfloat16()), TypeError, ["w2:", "float32", "bfloat16"]),
    "w1-device": (dict(w1=torch.randn(E, 2 * F, H, device=META)), ValueError, ["w1:", "cpu", "meta"]),
    "w2-device": (dict(w2=torch.randn(E, H, F, device=META)), ValueError, ["w2:", "cpu", "meta"]),
    "w1-non-contiguous": (dict(w1=_non_contiguous((E, 2 * F, H))), ValueError, ["w1:", "contiguous"]),
    "w2-non-contiguous": (dict(w2=_non_contiguous((E, H, F))), ValueError, ["w2:", "contiguous"]),
    "counts-not-tensor": (dict(tokens_per_expert=[5, 3]), TypeError, ["tokens_per_expert:", "torch.Tensor"]),
    "counts-ndim": (dict(tokens_per_expert=torch.tensor([[5, 3]])), ValueError, ["tokens_per_expert:", "[E]"]),
    "counts-float": (dict(tokens_per_expert=torch.tensor([5.0, 3.0])), TypeError,
                     ["tokens_per_expert:", "int32 or int64", "float32"]),
    "counts-length": (dict(tokens_per_expert=torch.tensor([5, 3, 0])), ValueError,
                      ["tokens_per_expert:", "expected 2 entries", "got 3"]),
    "counts-device": (dict(tokens_per_expert=torch.tensor([5, 3], device=META)), ValueError,
                      ["tokens_per_expert:", "cpu", "meta"]),
    "counts-non-contiguous": (dict(tokens_per_expert=torch.tensor([5, 0, 3, 0])[::2]), ValueError,
                              ["tokens_per_expert:", "contiguous"]),
    "b1-shape": (dict(b1=torch.randn(E, F)), ValueError, ["b1:", "(2, 32)", "(2, 16)"]),
    "b1-ndim": (dict(b1=torch.randn(E * 2 * F)), ValueError, ["b1:", "[2, 32]"]),
    "b2-shape": (dict(b2=torch.randn(E + 1, H)), ValueError, ["b2:", "(2, 16)", "(3, 16)"]),
    "b1-dtype": (dict(b1=torch.randn(E, 2 * F).half()), TypeError, ["b1:", "float32", "float16"]),
    "b2-device": (dict(b2=torch.randn(E, H, device=META)), ValueError, ["b2:", "cpu", "meta"]),
    "b2-non-contiguous": (dict(b2=_non_contiguous((E, H))), ValueError, ["b2:", "contiguous"]),
    "probs-not-tensor": (dict(probs=[0.5] * T), TypeError, ["probs:", "torch.Tensor", "list"]),
    "probs-shape": (dict(probs=torch.rand(T, 1)), ValueError, ["probs:", "(10,)", "(10, 1)"]),
    "probs-int": (dict(probs=torch.ones(T, dtype=torch.int64)), TypeError, ["probs:", "floating", "int64"]),
    "probs-device": (dict(probs=torch.rand(T, device=META)), ValueError, ["probs:", "cpu", "meta"]),
    "probs-non-contiguous": (dict(probs=torch.rand(2 * T)[::2]), ValueError, ["probs:", "contiguous"]),
    "activation-unknown": (dict(activation="relu6"), ValueError, ["activation:", "'relu6'", "swiglu"]),
    "activation-type": (dict(activation=3), TypeError, ["activation:", "ActivationConfig", "int"]),
    "recipe-unknown-name": (dict(recipe="fp4"), ValueError, ["recipe:", "'fp4'", "mxfp8"]),
    "recipe-type": (dict(recipe=3.5), TypeError, ["recipe:", "float"]),
    "backend-unknown": (dict(backend="cutlass"), ValueError, ["backend:", "'cutlass'", "reference"]),
    "backend-cannot-run-here": (dict(backend="triton"), RuntimeError, ["backend='triton'", "cannot run on cpu"]),
}

DEBUG_BAD_INPUTS = {
    "debug-counts-negative": (dict(tokens_per_expert=torch.tensor([9, -1])), ValueError,
                              ["tokens_per_expert:", ">= 0", "expert 1", "-1"]),
    "debug-counts-past-T": (dict(tokens_per_expert=torch.tensor([6, 5])), ValueError,
                            ["tokens_per_expert:", "sum to 11", "10 rows"]),
}


def test_good_inputs_pass():
    y = call()
    assert y.shape == (T, H) and torch.isfinite(y).all()


def _check(overrides, exc, pieces):
    with pytest.raises(exc) as info:
        call(**overrides)
    message = str(info.value)
    for piece in pieces:
        assert piece in message, f"{piece!r} not in {message!r}"


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input(case, monkeypatch):
    # With TRITON_INTERPRET=1 the Triton backend runs on CPU; "cannot run here" needs it off.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _check(*BAD_INPUTS[case])


@pytest.mark.parametrize("case", sorted(DEBUG_BAD_INPUTS))
def test_debug_mode_count_checks(case):
    te_fused_moe.set_debug_mode(True)
    try:
        _check(*DEBUG_BAD_INPUTS[case])
    finally:
        te_fused_moe.set_debug_mode(None)


def test_debug_count_checks_also_from_environment(monkeypatch):
    monkeypatch.setenv("TE_FUSED_MOE_DEBUG", "1")
    assert te_fused_moe.ops.debug_mode()
    _check(*DEBUG_BAD_INPUTS["debug-counts-negative"])
    monkeypatch.setenv("TE_FUSED_MOE_DEBUG", "0")
    assert not te_fused_moe.ops.debug_mode()


def test_count_checks_do_not_read_counts_outside_debug_mode(monkeypatch):
    """The fast path must not read counts on the host: check_counts is only reached in debug mode."""
    reached = []
    monkeypatch.setattr(te_fused_moe.ops, "check_counts", lambda *a: reached.append(a))
    te_fused_moe.set_debug_mode(False)
    try:
        call()
        assert reached == []
        te_fused_moe.set_debug_mode(True)
        call()
        assert len(reached) == 1
    finally:
        te_fused_moe.set_debug_mode(None)


def test_activation_config_bad_limit():
    for limit in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="activation limit"):
            ActivationConfig("gpt_oss_swiglu", limit=limit)


def test_backend_that_does_not_support_the_call(monkeypatch):
    backend = get_backend("reference")
    monkeypatch.setattr(backend, "supports", lambda *a: Availability(False, "no such kernel yet"))
    with pytest.raises(ValueError, match=r"backend='reference' does not support this call: no such kernel yet"):
        call()


def test_auto_with_no_runnable_backend(monkeypatch):
    for name in ("reference", "triton", "cudnn"):
        monkeypatch.setattr(get_backend(name), "availability", lambda device, n=name: Availability(False, f"{n} off"))
    with pytest.raises(RuntimeError, match="no backend can run here.*reference: reference off"):
        call(backend="auto")


def test_docs_table_matches_tests():
    """docs/bad_inputs.md lists exactly the cases tested here, with the same exception type."""
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "bad_inputs.md").read_text()
    rows = re.findall(r"^\|\s*`([A-Za-z0-9-]+)`\s*\|[^|]*\|\s*`(\w+)`\s*\|", doc, flags=re.M)
    documented = dict(rows)
    tested = {k: v[1].__name__ for k, v in {**BAD_INPUTS, **DEBUG_BAD_INPUTS}.items()}
    assert documented == tested
