"""What the MXFP8 probes (``probe_mx_plain.py``, ``probe_mx_fc1.py``, ``probe_mx_dglu.py``) time on: DSv3's
routed shape balanced over its experts, on the recipe's 128-row schedule, with placeholder scales for
operands that are BF16 values (the kernels do not read them), and their results' header."""

from __future__ import annotations

ROUTED, HIDDEN, FFN, EXPERTS = 32768, 7168, 2048, 32


def balanced_problem(device: str = "cuda"):
    """(counts, schedule, MXFP8 spec, A's and B's placeholder scales of the right ranks, results' header),
    with torch's seed reset so that every probe draws the same inputs."""
    import torch

    from te_fused_moe.backends.triton.mxfp8 import quantize as Q
    from te_fused_moe.backends.triton.schedule import build_schedule

    torch.manual_seed(0)
    counts = torch.full((EXPERTS,), ROUTED // EXPERTS, dtype=torch.int32, device=device)
    a_scale = torch.zeros(1, 1, device=device, dtype=torch.uint8)
    b_scale = torch.zeros(1, 1, 1, device=device, dtype=torch.uint8)
    header = {"shape": [ROUTED, HIDDEN, FFN, EXPERTS], "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device == "cuda" else device}
    return counts, build_schedule(counts, ROUTED, Q.TILE), Q.MXSpec(), a_scale, b_scale, header
