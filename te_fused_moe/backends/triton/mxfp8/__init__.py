"""The MXFP8 recipe (TE's ``MXFP8BlockScaling``) on the Triton fast path for Hopper (sm_90).

Hopper has FP8 wgmma but no MX (block-scaled) tensor cores. By default every GEMM expands both FP8
operands exactly to BF16 in registers (times their E8M0 power-of-two scales) and runs a BF16 wgmma;
the alternative, FP8 wgmma per 32-wide K block with exact FP32 promotion, is kept as an option
(``gemm`` explains both and what the H200 measured). Either equals the block-scaled MMA of Blackwell
up to the order of the FP32 sums.

Modules: ``codec`` (E8M0 scale device functions; FP8 bytes come from ``fp8_block.codec``),
``quantize`` (quantize kernels, the per-step weight cache), ``gemm`` (grouped GEMMs and the
quantizing FC1 / dGLU epilogues), ``wgrad`` (weight gradients over each expert's tokens),
``autograd`` (the recipe's kernels for ``block_scaled.BlockScaledExpertMLP`` and its recipe check).
"""
