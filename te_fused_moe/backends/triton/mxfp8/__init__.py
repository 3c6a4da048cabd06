"""The MXFP8 recipe (TE's ``MXFP8BlockScaling``) on the Triton fast path for Hopper (sm_90).

Hopper has FP8 wgmma but no MX (block-scaled) tensor cores, so every GEMM runs FP8 ``tl.dot`` over
one 32-wide scale block per K step and promotes in FP32: ``acc += dot(a, b^T) * sa[:, None] * sb[None, :]``
with ``sa``/``sb`` = 2^(e8m0 - 127). E8M0 scales are powers of two, so this promotion is exact: the
result equals the block-scaled MMA of Blackwell up to the order of the FP32 sums.

Modules: ``codec`` (E8M0 scale device functions; FP8 bytes come from ``fp8_block.codec``),
``quantize`` (quantize kernels, the per-step weight cache), ``gemm`` (grouped GEMMs and the
quantizing FC1 / dGLU epilogues), ``wgrad`` (weight gradients over each expert's tokens),
``autograd`` (the ``torch.autograd.Function`` and the recipe/shape checks).
"""
