"""te_compat and swap with Transformer Engine's REAL PyTorch extension (where it imports: a GPU
machine with TE's compiled core installed). Skipped elsewhere; on CPU see tests/test_te_compat.py
(TE's real recipe classes) and tests/test_swap.py (a GroupedLinear stand-in).
"""

from __future__ import annotations

import pytest
import torch

from moe_reference import make_counts, rel_err
from te_fused_moe import recipes, swap, te_compat

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def te():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        import transformer_engine.pytorch as te_pytorch
    except Exception as error:  # TE absent, or its core library missing
        pytest.skip(f"transformer_engine.pytorch does not import here: {type(error).__name__}: {error}")
    return te_pytorch


def _recipe_for_this_gpu():
    from transformer_engine.common import recipe as te_recipe

    major, _ = torch.cuda.get_device_capability()
    if major >= 10:
        return te_recipe.MXFP8BlockScaling(), recipes.MXFP8BlockScaling()
    return te_recipe.Float8BlockScaling(), recipes.Float8BlockScaling()  # Hopper's block-scaled FP8


def test_autocast_recipe_follows_tes_autocast(te):
    te_recipe, ours = _recipe_for_this_gpu()
    autocast = getattr(te, "autocast", None)
    assert te_compat.autocast_recipe() is None
    if autocast is not None:
        with autocast(enabled=True, recipe=te_recipe):
            assert te_compat.autocast_recipe() == ours
    with te.fp8_autocast(enabled=True, fp8_recipe=te_recipe):
        assert te_compat.autocast_recipe() == ours
    assert te_compat.autocast_recipe() is None
    status = te_compat.te_status()
    assert status["pytorch_imports"] and status["recipes_load"]
    assert "import transformer_engine.common.recipe" == status["recipes_how"]


class TEExpertBlock(torch.nn.Module):
    """The documented pattern with TE's real GroupedLinear."""

    def __init__(self, te, experts, hidden, ffn):
        super().__init__()
        kwargs = dict(bias=True, params_dtype=torch.bfloat16, device="cuda")
        self.fc1 = te.GroupedLinear(experts, hidden, 2 * ffn, **kwargs)
        self.fc2 = te.GroupedLinear(experts, ffn, hidden, **kwargs)
        self.activation = "swiglu"

    def forward(self, x, m_splits):
        gate, up = self.fc1(x, m_splits).chunk(2, dim=-1)
        return self.fc2(torch.nn.functional.silu(gate) * up, m_splits)


def test_swap_real_te_grouped_linear_block(te):
    torch.manual_seed(0)
    parent = torch.nn.Module()
    parent.experts = TEExpertBlock(te, experts=4, hidden=128, ffn=64)
    counts = make_counts(512, 4, "empty")
    x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    splits = counts.to("cuda")
    y_te = parent.experts(x, splits)
    report = swap.swap_experts(parent, backend="auto")
    assert [e.name for e in report.entries] == ["experts"], str(report)
    y_fused = parent.experts(x, splits)
    assert rel_err(y_fused, y_te) < 2e-2  # both BF16
    swap.unswap_experts(parent)
    assert isinstance(parent.experts, TEExpertBlock)
    assert rel_err(parent.experts(x, splits), y_te) < 1e-6
