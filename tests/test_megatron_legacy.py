"""``moe_grouped_gemm_impl="legacy"`` (Megatron's ``GroupedMLP``, megatron-core < 0.19) and swapping
it for the fused experts. CPU, world size 1 (gloo); skipped where ``GroupedMLP`` no longer exists.

``GroupedMLP`` runs its GEMMs through the ``grouped_gemm`` CUDA package, which these CPU tests do
not have. Selecting it is checked up to Megatron's own "grouped_gemm is not available" refusal; to
run its forward for the swap test, :func:`_per_expert_gmm_stand_in` (test-only) replaces
``grouped_gemm.ops.gmm`` with a per-expert matmul, so Megatron's own ``GroupedMLP.forward`` reads
its merged weights exactly as on the GPU.
"""

import types

import pytest
import torch

pytest.importorskip("megatron.core")
experts_mod = pytest.importorskip("megatron.core.transformer.moe.experts")
if not hasattr(experts_mod, "GroupedMLP"):
    pytest.skip("this megatron-core has no GroupedMLP (0.19+): 'legacy' is refused, see test_megatron_config",
                allow_module_level=True)

from megatron_testing import build_moe_layer, init_model_parallel, make_config  # noqa: E402
from moe_reference import rel_err  # noqa: E402

BF16_TOL = 2e-2  # both sides in bf16; GroupedMLP rounds the FC1 output to bf16, the reference does not


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    from megatron_patches.cpu_compat import cpu_cuda_shim

    init_model_parallel(ep=1, etp=1)
    with cpu_cuda_shim():
        yield


def _per_expert_gmm_stand_in(a, b, batch_sizes, trans_b=False):
    """What ``grouped_gemm.ops.gmm`` computes: rows of expert e times ``b[e]`` (or ``b[e].T``)."""
    outputs, start = [], 0
    for e, rows in enumerate(batch_sizes.tolist()):
        w = b[e].t() if trans_b else b[e]
        outputs.append(a[start:start + rows] @ w)
        start += rows
    return torch.cat(outputs)


@pytest.fixture
def grouped_gemm_stand_in(monkeypatch):
    from megatron.core.transformer.moe import grouped_gemm_util

    monkeypatch.setattr(grouped_gemm_util, "assert_grouped_gemm_is_available", lambda: None)
    monkeypatch.setattr(grouped_gemm_util, "ops", types.SimpleNamespace(gmm=_per_expert_gmm_stand_in))


def test_legacy_selects_grouped_mlp():
    from megatron_patches.spec import experts_class, experts_spec

    config = make_config("legacy", dtype=torch.bfloat16)
    assert experts_class(experts_spec(config, use_te=False)) is experts_mod.GroupedMLP
    # Building it reaches GroupedMLP.__init__, which needs the grouped_gemm package
    with pytest.raises(AssertionError, match="Grouped GEMM is not available"):
        build_moe_layer(config)


@torch.no_grad()
def test_swap_legacy_grouped_mlp_keeps_weights(grouped_gemm_stand_in):
    from megatron_patches import swap_megatron_experts, unswap_megatron_experts

    torch.manual_seed(torch.randint(1 << 30, (1,)).item())
    layer = build_moe_layer(make_config("legacy", dtype=torch.bfloat16))
    original = layer.experts
    assert isinstance(original, experts_mod.GroupedMLP)
    x = torch.randn(6, 2, 16, dtype=torch.bfloat16)
    y_before, _ = layer(x)

    report = swap_megatron_experts(layer, impl="fused-reference")
    assert len(report) == 1 and report.entries[0].replaced == "GroupedMLP"
    y_swapped, _ = layer(x)
    assert rel_err(y_swapped.float(), y_before.float()) < BF16_TOL
    fused = layer.experts
    assert fused.linear_fc1.weight.shape == (4, 48, 16) and fused.linear_fc2.weight.shape == (4, 16, 24)

    fused.linear_fc2.weight[1:].mul_(1.5)  # "training" on the fused weights (experts 1..3)
    y_trained, _ = layer(x)
    back = unswap_megatron_experts(layer)
    assert len(back) == 1 and layer.experts is original
    y_back, _ = layer(x)
    assert rel_err(y_back.float(), y_trained.float()) < BF16_TOL
    assert rel_err(y_back.float(), y_before.float()) > 5 * BF16_TOL
    # expert 0 untouched, the others scaled, in GroupedMLP's merged weight2 [E*F, H]
    w2 = original.weight2.view(4, 24, 16)
    assert torch.equal(w2[0].t(), fused.linear_fc2.weight[0])
    assert torch.equal(w2[2].t(), fused.linear_fc2.weight[2])
