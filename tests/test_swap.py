"""swap_experts / unswap_experts on CPU.

TE's PyTorch extension does not import on a CPU machine, so detection is exercised with
``GroupedLinearStandIn``: a small torch module carrying the attributes TE 2.20's
``transformer_engine.pytorch.GroupedLinear`` has (``num_gemms``, ``in_features``, ``out_features``,
``use_bias``, ``return_bias``, ``weight{i}``, ``bias{i}``) and computing what it computes. It is not
TE. Real TE modules are covered in tests/gpu/test_te_pytorch.py where TE imports.
"""

from __future__ import annotations

import pytest
import torch

from moe_reference import expert_mlp_fp64, make_counts, rel_err
from te_fused_moe import swap
from te_fused_moe.activations import ActivationConfig, apply_activation

GEN = torch.Generator().manual_seed(6)


class GroupedLinearStandIn(torch.nn.Module):
    """Stand-in with TE GroupedLinear's attributes: ``y[rows of g] = x[rows of g] @ weight{g}.T + bias{g}``."""

    def __init__(self, num_gemms, in_features, out_features, bias=True, dtype=torch.float64):
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, False
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(
                torch.randn(out_features, in_features, generator=GEN, dtype=dtype) / in_features ** 0.5))
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(
                    torch.randn(out_features, generator=GEN, dtype=dtype) * 0.1))

    def forward(self, x, m_splits):
        sizes = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        rows = torch.split(x[:sum(sizes)], sizes)
        outs = [r @ getattr(self, f"weight{i}").T + (getattr(self, f"bias{i}") if self.use_bias else 0)
                for i, r in enumerate(rows)]
        return torch.cat(outs + [x.new_zeros(x.shape[0] - sum(sizes), self.out_features)])


class ExpertBlockStandIn(torch.nn.Module):
    """The documented pattern: two GroupedLinear children and an activation between them."""

    def __init__(self, experts, hidden, ffn, activation="swiglu", bias=True, act_module=None):
        super().__init__()
        gated = ActivationConfig(activation).gated
        self.fc1 = GroupedLinearStandIn(experts, hidden, 2 * ffn if gated else ffn, bias)
        self.fc2 = GroupedLinearStandIn(experts, ffn, hidden, bias)
        if act_module is None:
            self.activation = activation
            self._act = ActivationConfig(activation)
        else:
            self.act = act_module
            self._act = None

    def forward(self, x, m_splits):
        h = self.fc1(x, m_splits)
        a = apply_activation(h, self._act) if self._act is not None else self._gated(h)
        return self.fc2(a, m_splits)

    def _gated(self, h):
        if self.fc1.out_features == 2 * self.fc2.in_features:
            gate, up = h.chunk(2, dim=-1)
            return self.act(gate) * up
        return self.act(h)


class Model(torch.nn.Module):
    def __init__(self, **block_kwargs):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.layers = torch.nn.ModuleList([ExpertBlockStandIn(3, 8, 32, **block_kwargs) for _ in range(2)])

    def forward(self, x, m_splits):
        x = self.proj(x)
        for layer in self.layers:
            x = x + layer(x, m_splits)
        return x


def _inputs(tokens=40, experts=3, padding=3):
    x = torch.randn(tokens, 8, generator=GEN, dtype=torch.float64)
    counts = make_counts(tokens, experts, "empty", generator=GEN, padding=padding)
    return x, counts


@pytest.mark.parametrize("activation,act_module", [
    ("swiglu", None), ("gpt_oss_swiglu", None), ("srelu", None),
    ("swiglu", torch.nn.SiLU()), ("geglu", torch.nn.GELU()), ("silu", torch.nn.SiLU()),
])
def test_swapped_model_computes_the_same_and_round_trips(activation, act_module):
    model = Model(activation=activation, act_module=act_module)
    x, counts = _inputs()
    y_before = model(x, counts)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}

    report = swap.swap_experts(model, backend="reference")
    assert [e.name for e in report.entries] == ["layers.0", "layers.1"] and not report.skipped
    assert all(isinstance(layer, swap.SwappedGroupedMLP) for layer in model.layers)
    assert model.layers[0].activation.name == activation
    y_list = model(x, counts.tolist())  # TE-style list m_splits work too
    y_after = model(x, counts)
    assert rel_err(y_after, y_before) < 1e-12 and torch.equal(y_after, y_list)

    # Each swapped block on its own equals the FP64 per-expert loop with the original weights.
    block = model.layers[0]
    ref = expert_mlp_fp64(x, counts, block.weight1, block.weight2, activation, b1=block.bias1, b2=block.bias2)
    assert rel_err(block(x, counts), ref["y"]) < 1e-12

    with torch.no_grad():  # "train" the fused weights, then unswap: the change must come back
        model.layers[1].weight2.mul_(1.5)
    back = swap.unswap_experts(model)
    assert len(back) == 2 and all(isinstance(layer, ExpertBlockStandIn) for layer in model.layers)
    state_after = model.state_dict()
    for key, value in state_before.items():
        if key.startswith("layers.1.fc2.weight"):
            assert torch.allclose(state_after[key], value * 1.5, rtol=0, atol=1e-15), key
        else:
            assert torch.equal(state_after[key], value), key


def test_gradients_match_the_original_block():
    block_model = Model(activation="swiglu")
    x, counts = _inputs()
    block_model(x, counts).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block_model.layers[0].named_parameters()}
    block_model.zero_grad()
    swap.swap_experts(block_model, backend="reference")
    block_model(x, counts).square().sum().backward()
    fused = block_model.layers[0]
    for i in range(3):
        assert rel_err(fused.weight1.grad[i], grads[f"fc1.weight{i}"]) < 1e-12
        assert rel_err(fused.weight2.grad[i], grads[f"fc2.weight{i}"]) < 1e-12
        assert rel_err(fused.bias1.grad[i], grads[f"fc1.bias{i}"]) < 1e-12


def test_blocks_that_cannot_be_honoured_are_reported_not_swapped():
    cases = {
        "one-sided bias": lambda b: setattr(b.fc2, "use_bias", False),
        "return_bias": lambda b: setattr(b.fc1, "return_bias", True),
        "tensor-parallel": lambda b: setattr(b.fc1, "tp_size", 2),
        "no activation": lambda b: delattr(b, "activation"),
        "tanh GELU": lambda b: (delattr(b, "activation"), b.add_module("act", torch.nn.GELU(approximate="tanh"))),
        "extra parameter": lambda b: b.register_parameter("scale", torch.nn.Parameter(torch.ones(1))),
        "gating mismatch": lambda b: setattr(b, "activation", "silu"),
    }
    expected = {
        "one-sided bias": "bias on one linear only", "return_bias": "return_bias=True",
        "tensor-parallel": "tp_size=2", "no activation": "no activation declared", "tanh GELU": "approximate='tanh'",
        "extra parameter": "parameters besides", "gating mismatch": "'silu' is not gated",
    }
    for label, break_it in cases.items():
        model = Model(activation="swiglu")
        break_it(model.layers[0])
        report = swap.swap_experts(model, backend="reference")
        assert [e.name for e in report.entries] == ["layers.1"], label
        assert report.skipped[0][0] == "layers.0" and expected[label] in report.skipped[0][1], (label, report)
        assert isinstance(model.layers[0], ExpertBlockStandIn)


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        swap.swap_experts("not a model")
    with pytest.raises(ValueError, match="backend: expected one of"):
        swap.swap_experts(Model(), backend="cublas")
    with pytest.raises(ValueError, match="unknown recipe name"):
        swap.swap_experts(Model(), recipe="fp3")
    block = ExpertBlockStandIn(2, 8, 32)
    with pytest.raises(ValueError, match="the model itself is an expert block"):
        swap.swap_experts(block)
    fused = swap.fused_from_block(block, backend="reference")
    x, counts = _inputs(experts=2)
    assert rel_err(fused(x, counts), block(x, counts)) < 1e-12
    assert swap.swap_experts(torch.nn.Linear(2, 2)).entries == []


def test_recipe_reaches_the_swapped_modules_and_keep_original_false_frees_them():
    model = Model(activation="swiglu")
    swap.swap_experts(model, backend="reference", recipe="mxfp8", keep_original=False)
    assert all(layer.recipe.name == "mxfp8" for layer in model.layers)
    report = swap.unswap_experts(model)
    assert not report.entries and [n for n, _ in report.skipped] == ["layers.0", "layers.1"]


def test_megatron_expert_modules_are_handed_to_megatron_patches():
    from megatron_testing import build_experts, init_model_parallel, make_config
    from megatron.core.transformer.moe.experts import SequentialMLP

    init_model_parallel(ep=1, etp=1)

    class Mixed(torch.nn.Module):  # Megatron experts next to a TE-style block
        def __init__(self):
            super().__init__()
            self.experts = build_experts(make_config("sequential", activation="swiglu"), 4)
            self.block = ExpertBlockStandIn(3, 8, 32)

    model = Mixed()
    original = model.experts
    x = torch.randn(10, 16, generator=GEN)
    counts = torch.tensor([3, 0, 5, 2])
    probs = torch.rand(10, generator=GEN)
    y_before, _ = model.experts(x, counts, probs)
    with pytest.raises(ValueError, match="Megatron expert modules take their recipe"):
        swap.swap_experts(Mixed(), recipe="mxfp8")
    report = swap.swap_experts(model, backend="reference")
    assert sorted(e.name for e in report.entries) == ["block", "experts"]
    assert type(model.experts).__name__ == "FusedExpertsMLP"
    assert any("fused-reference" in e.by for e in report.entries)
    y_after, _ = model.experts(x, counts, probs)
    assert rel_err(y_after, y_before) < 2e-5  # FP32 both sides
    back = swap.unswap_experts(model)
    assert sorted(e.name for e in back.entries) == ["block", "experts"]
    assert model.experts is original and isinstance(original, SequentialMLP)
    assert isinstance(model.block, ExpertBlockStandIn)
