"""Swapped TE-style expert blocks on the GPU: called with host ``m_splits`` (a list, as TE's
GroupedLinear takes them) the replacement makes no host sync.

Run on the device machine: ``pytest -m gpu tests/gpu/test_swap_gpu.py``. Not yet run on a GPU.
"""

import pytest
import torch

from te_fused_moe import swap

pytestmark = pytest.mark.gpu


def test_list_m_splits_make_no_host_sync():
    fused = swap.SwappedGroupedMLP(num_experts=4, hidden_size=128, ffn_hidden_size=64, backend="triton",
                                   params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m_splits = [100, 0, 120, 30]  # 6 padding rows
    expected = fused(x, torch.tensor(m_splits, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = fused(x, m_splits)  # used to be torch.tensor(m_splits, device="cuda"): copy + stream sync
        y.backward(torch.randn_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, expected)
