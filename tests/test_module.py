"""FusedGroupedMLP: parameters, init, state dict, recipe resolution, and forward/backward against
the FP64 per-expert loop."""

import ast
import inspect
import pathlib

import pytest
import torch

import te_fused_moe
from moe_reference import expert_mlp_fp64, make_counts, rel_err
from te_fused_moe import module as module_lib
from te_fused_moe.module import FusedGroupedMLP
from te_fused_moe.recipes import BF16Recipe, MXFP8BlockScaling, NVFP4BlockScaling


def test_lazy_export():
    assert te_fused_moe.FusedGroupedMLP is FusedGroupedMLP


@pytest.mark.parametrize("activation,gated", [("swiglu", True), ("gpt_oss_swiglu", True), ("srelu", False)])
def test_parameter_shapes_and_state_dict(activation, gated):
    m = FusedGroupedMLP(5, 32, 16, activation=activation, bias=True, params_dtype=torch.bfloat16)
    n1 = 32 if gated else 16
    assert m.weight1.shape == (5, n1, 32) and m.weight2.shape == (5, 32, 16)
    assert m.bias1.shape == (5, n1) and m.bias2.shape == (5, 32)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert list(m.state_dict()) == ["weight1", "weight2", "bias1", "bias2"]
    no_bias = FusedGroupedMLP(5, 32, 16, activation=activation)
    assert list(no_bias.state_dict()) == ["weight1", "weight2"] and no_bias.bias1 is None


def test_default_dtype_and_device():
    m = FusedGroupedMLP(2, 16, 16)
    assert m.weight1.dtype == torch.get_default_dtype() and m.weight1.device.type == "cpu"
    meta = FusedGroupedMLP(2, 16, 16, device="meta")
    assert meta.weight1.device.type == "meta"


def test_default_init_is_megatron_normal():
    torch.manual_seed(0)
    m = FusedGroupedMLP(8, 256, 128, bias=True)
    for w in (m.weight1, m.weight2):
        assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    assert torch.all(m.bias1 == 0) and torch.all(m.bias2 == 0)
    # each expert drawn separately, not copies of one
    assert not torch.equal(m.weight1[0], m.weight1[1])


def test_init_methods_called_per_expert_slice():
    seen = {"fc1": [], "fc2": []}

    def fc1_init(t):
        seen["fc1"].append(tuple(t.shape))
        t.fill_(len(seen["fc1"]))

    def fc2_init(t):
        seen["fc2"].append(tuple(t.shape))
        t.fill_(-len(seen["fc2"]))

    m = FusedGroupedMLP(3, 16, 32, init_method=fc1_init, output_layer_init_method=fc2_init)
    assert seen == {"fc1": [(64, 16)] * 3, "fc2": [(16, 32)] * 3}
    for e in range(3):
        assert torch.all(m.weight1[e] == e + 1) and torch.all(m.weight2[e] == -(e + 1))
    m.reset_parameters()
    assert len(seen["fc1"]) == 6 and torch.all(m.weight1[2] == 6)


def test_extra_repr():
    m = FusedGroupedMLP(4, 32, 16, activation="gpt_oss_swiglu", bias=True, recipe="mxfp8", backend="reference")
    text = repr(m)
    for piece in ("num_experts=4", "hidden_size=32", "ffn_hidden_size=16", "'gpt_oss_swiglu'", "bias=True",
                  "recipe=mxfp8", "backend='reference'", "limit=7.0"):
        assert piece in text, (piece, text)
    assert "auto (TE autocast" in repr(FusedGroupedMLP(1, 16, 16))


@pytest.mark.parametrize("bad", [dict(num_experts=0), dict(hidden_size=-1), dict(ffn_hidden_size=2.5),
                                 dict(activation="relu6"), dict(recipe="fp4")])
def test_constructor_rejects_bad_arguments(bad):
    kwargs = dict(num_experts=2, hidden_size=16, ffn_hidden_size=16)
    kwargs.update(bad)
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        FusedGroupedMLP(**kwargs)


def _fp64_check(m, x, counts, probs, tol):
    params = {n: p for n, p in m.named_parameters()}
    y = m(x, counts, probs)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = expert_mlp_fp64(x, counts, m.weight1, m.weight2, m.activation.name, m.bias1, m.bias2, probs,
                          alpha=m.activation.alpha, limit=m.activation.limit, dy=dy)
    assert rel_err(y, ref["y"]) < tol
    assert rel_err(x.grad, ref["x"]) < tol
    for ours, theirs in (("weight1", "w1"), ("weight2", "w2"), ("bias1", "b1"), ("bias2", "b2")):
        if ours in params:
            assert rel_err(params[ours].grad, ref[theirs]) < tol, ours
    if probs is not None:
        assert rel_err(probs.grad, ref["probs"]) < tol


@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss_swiglu", "srelu"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_forward_backward_vs_fp64(activation, dtype, tol):
    torch.manual_seed(1)
    m = FusedGroupedMLP(6, 32, 16, activation=activation, bias=True, params_dtype=dtype, backend="reference",
                        activation_limit=3.0, init_method=lambda t: torch.nn.init.normal_(t, 0, 0.2))
    with torch.no_grad():  # non-zero biases so their use is checked
        m.bias1.normal_(0, 0.1)
        m.bias2.normal_(0, 0.1)
    x = torch.randn(50, 32).to(dtype).requires_grad_(True)
    counts = make_counts(46, 6, "zipf")  # 4 padding rows
    probs = (torch.rand(50) + 0.05).requires_grad_(True)
    _fp64_check(m, x, counts, probs, tol)


def test_recipe_resolution(monkeypatch):
    monkeypatch.setattr(module_lib, "_te_autocast_recipe", lambda: None)
    assert isinstance(FusedGroupedMLP(1, 16, 16).active_recipe(), BF16Recipe)

    monkeypatch.setattr(module_lib, "_te_autocast_recipe", lambda: MXFP8BlockScaling())
    assert isinstance(FusedGroupedMLP(1, 16, 16).active_recipe(), MXFP8BlockScaling)
    # an explicit recipe wins over TE's autocast, BF16 included
    assert isinstance(FusedGroupedMLP(1, 16, 16, recipe="nvfp4").active_recipe(), NVFP4BlockScaling)
    assert isinstance(FusedGroupedMLP(1, 16, 16, recipe="bf16").active_recipe(), BF16Recipe)


def test_autocast_recipe_read_through_te_compat(monkeypatch):
    """The module asks te_compat.autocast_recipe(), and copes when it is missing."""
    from te_fused_moe import te_compat
    monkeypatch.setattr(te_compat, "autocast_recipe", lambda: NVFP4BlockScaling())
    assert isinstance(FusedGroupedMLP(1, 16, 16).active_recipe(), NVFP4BlockScaling)
    monkeypatch.delattr(te_compat, "autocast_recipe")
    assert isinstance(FusedGroupedMLP(1, 16, 16).active_recipe(), BF16Recipe)


def test_no_te_autocast_means_bf16():
    # TE is not installed in the CPU CI environment, so nothing can be active.
    assert isinstance(FusedGroupedMLP(1, 16, 16).active_recipe(), BF16Recipe)


def test_forward_passes_module_settings_to_op(monkeypatch):
    captured = {}

    def fake_op(x, counts, w1, w2, **kwargs):
        captured.update(kwargs, x=x, counts=counts, w1=w1, w2=w2)
        return x

    monkeypatch.setattr(module_lib, "fused_moe_mlp", fake_op)
    monkeypatch.setattr(module_lib, "_te_autocast_recipe", lambda: MXFP8BlockScaling())
    m = FusedGroupedMLP(2, 16, 16, activation="gpt_oss_swiglu", activation_alpha=1.5, activation_limit=4.0,
                        bias=True, backend="reference", deterministic=True)
    x, counts, probs = torch.randn(4, 16), torch.tensor([1, 3]), torch.rand(4)
    m(x, counts, probs)
    assert captured["w1"] is m.weight1 and captured["w2"] is m.weight2
    assert captured["b1"] is m.bias1 and captured["b2"] is m.bias2 and captured["probs"] is probs
    assert captured["counts"] is counts and captured["backend"] == "reference" and captured["deterministic"]
    assert isinstance(captured["recipe"], MXFP8BlockScaling)
    act = captured["activation"]
    assert (act.name, act.alpha, act.limit) == ("gpt_oss_swiglu", 1.5, 4.0)


def test_module_does_not_import_backends():
    """module -> op -> backend: the module layer never reaches into a backend."""
    tree = ast.parse(pathlib.Path(inspect.getfile(module_lib)).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert "backends" not in (node.module or ""), node.module
            assert all("backends" not in a.name for a in node.names)
        elif isinstance(node, ast.Import):
            assert all("backends" not in a.name for a in node.names)


def test_load_state_dict_round_trip():
    a = FusedGroupedMLP(3, 16, 16, bias=True)
    b = FusedGroupedMLP(3, 16, 16, bias=True)
    b.load_state_dict(a.state_dict())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_autocast_recipe_reaches_the_computation(monkeypatch):
    """End to end: a module without a recipe under (mocked) TE autocast computes what an explicit
    MXFP8 module computes, and differs from BF16."""
    torch.manual_seed(3)
    explicit = FusedGroupedMLP(3, 64, 32, recipe="mxfp8", backend="reference")
    implicit = FusedGroupedMLP(3, 64, 32, backend="reference")
    implicit.load_state_dict(explicit.state_dict())
    x, counts = torch.randn(40, 64), torch.tensor([10, 0, 28])
    y_bf16 = implicit(x, counts)
    monkeypatch.setattr(module_lib, "_te_autocast_recipe", lambda: MXFP8BlockScaling())
    y_auto = implicit(x, counts)
    assert torch.equal(y_auto, explicit(x, counts))
    assert rel_err(y_auto, y_bf16) > 1e-2
