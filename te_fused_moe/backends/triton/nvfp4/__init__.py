"""The NVFP4 recipe (TE's ``NVFP4BlockScaling``) on the Triton fast path for Hopper (sm_90).

Hopper has no FP4 tensor cores: every GEMM expands its E2M1 operands times their E4M3 block
scales exactly to BF16 in registers and runs a BF16 wgmma; the FP32 tensor scales are one factor
per tile in the epilogue. Equal to Blackwell's block-scaled FP4 MMA up to the order of FP32 sums.

Modules: ``codec`` (E2M1 / E4M3 / tensor-scale device functions), ``quantize`` (per-expert amax
and quantize kernels with RHT and stochastic rounding, the per-step weight cache), ``gemm``
(grouped GEMMs with the FC1 / dGLU epilogues), ``wgrad`` (weight gradients over each expert's
tokens), ``autograd`` (the autograd Function and the backend's entry).
"""
