"""The CUDA toolkit's ptxas (``TE_FUSED_MOE_PTXAS=toolkit``, te_fused_moe/backends/triton/ptxas.py)
changes only the SASS's scheduling hints, so the FP8 block MLP's forward and backward must give the
same bits under it as under Triton's own ptxas. Each ptxas runs in its own process (Triton keeps one
per process); both build the same random problem: ragged routing with an empty expert, enough tiles
for every persistent kernel's ring to wrap."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import sys, torch
from te_fused_moe.ops import fused_moe_mlp
from te_fused_moe.recipes import Float8BlockScaling
from te_fused_moe.backends.triton.ptxas import in_use

torch.manual_seed(int(sys.argv[2]))
T, H, F, E = 6144, 1024, 512, 8
counts = torch.tensor([1536, 0, 1024, 640, 1152, 384, 896, 512], dtype=torch.int32, device="cuda")
assert int(counts.sum()) == T
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
w1 = (torch.randn(E, 2 * F, H, device="cuda") * H ** -0.5).bfloat16().requires_grad_()
w2 = (torch.randn(E, H, F, device="cuda") * F ** -0.5).bfloat16().requires_grad_()
dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
y = fused_moe_mlp(x, counts, w1, w2, activation="swiglu", recipe=Float8BlockScaling(), backend="triton")
y.backward(dy)
torch.cuda.synchronize()
out = {name: t.detach().view(torch.int16).cpu() for name, t in
       (("y", y), ("dx", x.grad), ("dw1", w1.grad), ("dw2", w2.grad))}
used = in_use()
torch.save(dict(out, ptxas=(used.path, used.version)), sys.argv[1])
"""


def _run(setting: str, path: str, seed: int) -> dict:
    from te_fused_moe.backends.triton import ptxas

    env = {k: v for k, v in os.environ.items() if k not in (ptxas.triton_env(), "TRITON_INTERPRET")}
    env.update(TE_FUSED_MOE_PTXAS=setting, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", CHILD, path, str(seed)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_block_mlp_bitwise_the_same_under_either_ptxas(tmp_path, seed):
    from te_fused_moe.backends.triton import ptxas

    # what TE_FUSED_MOE_PTXAS=toolkit would take: >= 12.9 and newer than Triton's own (Triton 3.9's
    # ptxas-blackwell, 13.4, is newer than CUDA 13.0's)
    found = ptxas.resolve({k: v for k, v in os.environ.items() if k != ptxas.triton_env()} | {ptxas.ENV: "auto"})
    if found is None:
        pytest.skip(f"no CUDA toolkit ptxas >= 12.9 and newer than Triton's {ptxas.triton_bundled().version} here "
                    f"(found {ptxas.toolkit(os.environ)}): nothing to compare")
    ours = _run("triton", str(tmp_path / "triton.pt"), seed)
    toolkit = _run("toolkit", str(tmp_path / "toolkit.pt"), seed)
    assert ours["ptxas"][1] == ptxas.triton_bundled().version and toolkit["ptxas"][0] == found.path, \
        (ours["ptxas"], toolkit["ptxas"])
    for name in ("y", "dx", "dw1", "dw2"):
        a, b = ours[name], toolkit[name]
        assert a.shape == b.shape, name
        assert torch.isfinite(a.view(torch.bfloat16).float()).all(), name
        assert a.view(torch.bfloat16).float().abs().sum() > 0, name
        differ = int((a != b).sum())
        assert differ == 0, f"{name}: {differ} of {a.numel()} elements differ between ptxas builds"
    # the empty expert's weight gradients are zeros under both, not left unwritten
    assert (ours["dw1"][1].view(torch.bfloat16) == 0).all() and (ours["dw2"][1].view(torch.bfloat16) == 0).all()
