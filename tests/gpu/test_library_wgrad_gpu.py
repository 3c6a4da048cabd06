"""The BF16-valued wgrads on cuBLAS's grouped GEMM (``backends/triton/library_wgrad.py``) on the GPU: the checks
of tests/test_library_wgrad.py on CUDA (there PyTorch's CPU fallback ran), and where the route applies.
The MLP through it: tests/gpu/test_triton_mxfp8_gpu.py's ``-cublaswgrad`` cases."""

import json

import pytest
import torch

import test_library_wgrad as checks
from te_fused_moe.backends.triton import library_wgrad

pytestmark = pytest.mark.gpu


def test_values_wgrad_matches_fp64_gpu():
    # (the result is torch._grouped_mm's own tensor, which cannot be poisoned beforehand: every element is
    # compared, an expert with no tokens must be exactly zero)
    r = checks.check_values_wgrad("cuda", seed=int(torch.randint(0, 2 ** 16, ())))
    print("LIBRARY_WGRAD", json.dumps(r))
    checks.assert_values_wgrad(r)


def test_applies_to_bf16_values_on_sm90_only_gpu():
    values = torch.zeros(4, 128, device="cuda", dtype=torch.bfloat16)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert library_wgrad.applies(values, values, values) == sm90
    assert not library_wgrad.applies(values, values.view(torch.uint8)[:, :128], values)
    assert not library_wgrad.applies(values, values, values.float())
