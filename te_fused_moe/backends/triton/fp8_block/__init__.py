"""The FP8 block recipe (TE's ``Float8BlockScaling``, DeepSeek-V3 style) on the Triton fast path.

Modules: ``codec`` (scale and FP8 encoding device functions), ``quantize`` (quantize kernels and the
per-step weight cache), ``gemm`` (FP8 grouped GEMMs with per-128-K-block scale promotion and the
quantizing MoE epilogues), ``wgrad`` (FP8 weight gradients over each expert's tokens), ``autograd``
(the ``torch.autograd.Function``).
"""
