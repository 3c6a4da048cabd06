"""Quantized recipes picked from Megatron's config, through a real ``MoELayer`` (router, alltoall
dispatcher, FusedExpertsMLP with the reference backend), CPU/gloo, world size 1.

* ``fp8``/``fp8_recipe`` = mxfp8 / blockwise (E4M3 and HYBRID) and ``fp4``/``fp4_recipe`` = nvfp4
  reach the experts as our recipes, and the layer's expert output (and, for the FP8 recipes, the
  gradients) equal the FP64 per-expert loop on the same fake-quantized operands
  (tests/fake_quant_reference.py) fed with the rows, counts and probs the dispatcher produced.
* ``moe_router_padding_for_quantization``: Megatron pads the routing map (extra copies of tokens
  with probability 0) so every expert's count is a multiple of the recipe's alignment; the experts
  take those counts, and the layer output equals the unpadded layer's.

Why the FP8 fields are set after the config is built: megatron-core 0.16 and 0.19 refuse
``fp8`` together with ``num_moe_experts`` in ``TransformerConfig.__post_init__`` unless Transformer
Engine is installed (it checks TE's version), and these CPU tests run without TE. With TE (the GPU
path) ``--fp8-format e4m3 --fp8-recipe mxfp8`` is passed to the constructor as usual.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from fake_quant_reference import quantized_expert_mlp_fp64  # noqa: E402
from megatron_testing import build_moe_layer, init_model_parallel, make_config  # noqa: E402
from moe_reference import rel_err  # noqa: E402

# FP32 compute vs FP64 on the same fake-quantized operands: an operand element may land on a
# neighbouring code now and then (tests/test_reference_backend.py measured up to 5e-5).
QUANT_TOL = 2e-3
H, F, E = 64, 48, 4

RECIPES = {
    # id: (Megatron config fields, our recipe name, fp8 format or None, compare gradients)
    "mxfp8-e4m3": (dict(fp8="e4m3", fp8_recipe="mxfp8"), "mxfp8", "E4M3", True),
    "mxfp8-hybrid": (dict(fp8="hybrid", fp8_recipe="mxfp8"), "mxfp8", "HYBRID", True),
    "blockwise-e4m3": (dict(fp8="e4m3", fp8_recipe="blockwise"), "fp8_block", "E4M3", True),
    # NVFP4's default recipe rounds gradients stochastically: forward only.
    "nvfp4": (dict(fp4="e2m1", fp4_recipe="nvfp4"), "nvfp4", None, False),
}


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    from megatron_patches.cpu_compat import cpu_cuda_shim

    init_model_parallel(ep=1, etp=1)
    with cpu_cuda_shim():
        yield


def _config(fields, padding=False):
    config = make_config("fused-reference", hidden=H, ffn=F, experts=E, topk=2, dispatcher="alltoall")
    for name, value in fields.items():  # see the module docstring: fp8 + MoE needs TE at construction
        setattr(config, name, value)
    config.moe_router_padding_for_quantization = padding
    return config


class _ExpertsTap:
    """Records what the dispatcher hands the experts and what they return (and its gradient)."""

    def __init__(self, experts):
        self.calls = []
        self.handle = experts.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        x, counts, probs = inputs
        x.retain_grad()
        call = {"x": x, "counts": counts.detach().clone(), "probs": probs.detach().clone(), "y": output[0].detach()}
        output[0].register_hook(lambda g: call.__setitem__("dy", g.detach().clone()))
        self.calls.append(call)


def _run_layer(layer, x, dy):
    tap = _ExpertsTap(layer.experts)
    xi = x.clone().requires_grad_(True)
    out, _ = layer(xi)
    out.backward(dy)
    tap.handle.remove()
    (call,) = tap.calls
    return out.detach(), call


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_from_megatron_config_matches_fake_quantized_fp64(name):
    from te_fused_moe.recipes import Format

    fields, recipe_name, fmt, check_grads = RECIPES[name]
    torch.manual_seed(torch.randint(1 << 30, (1,)).item())
    layer = build_moe_layer(_config(fields))
    experts = layer.experts
    assert experts.recipe.name == recipe_name
    if fmt is not None:
        assert experts.recipe.fp8_format is Format[fmt]
    x = torch.randn(16, 3, H)
    dy = torch.randn(16, 3, H)
    _, call = _run_layer(layer, x, dy)
    ref = quantized_expert_mlp_fp64(call["x"], call["counts"], experts.linear_fc1.weight, experts.linear_fc2.weight,
                                    experts.recipe, activation="swiglu", probs=call["probs"], dy=call["dy"])
    routed = int(call["counts"].sum())
    assert routed > 0
    assert rel_err(call["y"][:routed], ref["y"][:routed]) < QUANT_TOL
    # quantization did happen: the same layer in BF16-recipe arithmetic differs by more than rounding
    from te_fused_moe.recipes import BF16Recipe

    plain = quantized_expert_mlp_fp64(call["x"], call["counts"], experts.linear_fc1.weight,
                                      experts.linear_fc2.weight, BF16Recipe(), activation="swiglu",
                                      probs=call["probs"])
    assert rel_err(call["y"][:routed], plain["y"][:routed]) > 5e-3
    if check_grads:
        assert rel_err(experts.linear_fc1.weight.grad, ref["w1"]) < QUANT_TOL
        assert rel_err(experts.linear_fc2.weight.grad, ref["w2"]) < QUANT_TOL
        assert rel_err(call["x"].grad, ref["x"]) < QUANT_TOL


@pytest.mark.parametrize("name,align", [("mxfp8-e4m3", 32), ("blockwise-e4m3", 16)])
def test_router_padding_for_quantization(name, align):
    """Padded counts (multiples of Megatron's alignment) give the unpadded layer's output."""
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    fields = RECIPES[name][0]
    torch.manual_seed(torch.randint(1 << 30, (1,)).item())
    padded_layer = build_moe_layer(_config(fields, padding=True))
    plain_layer = build_moe_layer(_config(fields, padding=False))
    plain_layer.load_state_dict(padded_layer.state_dict())
    assert get_align_size_for_quantization(padded_layer.config) == align
    # 40 tokens x top-2 over 4 experts: padding an expert up to the next multiple of 32 always
    # finds enough tokens not yet routed to it.
    x = torch.randn(20, 2, H)
    dy = torch.randn(20, 2, H)
    out_pad, call_pad = _run_layer(padded_layer, x, dy)
    out_plain, call_plain = _run_layer(plain_layer, x, dy)
    counts = call_pad["counts"]
    assert torch.all(counts % align == 0), counts
    assert int(counts.sum()) > int(call_plain["counts"].sum())  # padding rows were added
    assert torch.all(counts >= call_plain["counts"])
    assert rel_err(out_pad, out_plain) < 1e-6
    # weight gradients: the padding rows carry probability 0, so only the quantization blocks of
    # the gradient GEMMs see them (FP8 rounding of dy blocks changes a little)
    for param in ("linear_fc1", "linear_fc2"):
        g_pad = getattr(padded_layer.experts, param).weight.grad
        g_plain = getattr(plain_layer.experts, param).weight.grad
        assert rel_err(g_pad, g_plain) < 0.15, param


def test_unsupported_quantization_settings_are_refused():
    from types import SimpleNamespace

    from megatron_patches.recipe import recipe_from_config

    with pytest.raises(ValueError, match="fp8='e5m2': expected 'e4m3' or 'hybrid'"):
        recipe_from_config(SimpleNamespace(fp8="e5m2", fp8_recipe="mxfp8", fp4=None))
    with pytest.raises(ValueError, match="fp8_recipe='tensorwise' is not implemented"):
        recipe_from_config(SimpleNamespace(fp8="e4m3", fp8_recipe="tensorwise", fp4=None))
    with pytest.raises(ValueError, match="first_last_layers_bf16=True is not supported"):
        recipe_from_config(SimpleNamespace(fp8="e4m3", fp8_recipe="mxfp8", fp4=None, first_last_layers_bf16=True))
    # without quantization the flag changes nothing for the experts
    assert recipe_from_config(SimpleNamespace(fp8=None, fp4=None, first_last_layers_bf16=True)).name == "bf16"
    # and the expert class refuses at build time, naming the field
    config = _config(dict(fp8="e4m3", fp8_recipe="blockwise"))
    config.first_last_layers_bf16 = True
    with pytest.raises(ValueError, match="first_last_layers_bf16"):
        build_moe_layer(config)
