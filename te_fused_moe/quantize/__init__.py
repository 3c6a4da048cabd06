"""Quantizers, one module per format, plus ``fake_quantize`` (quantize then dequantize) used by the
reference backend to emulate a recipe exactly.

    mxfp8.py      E4M3/E5M2 values, E8M0 scale per 32 elements
    nvfp4.py      E2M1 values, E4M3 scale per 16 elements, FP32 tensor scale (+2D blocks, SR, RHT)
    fp8_block.py  E4M3 values, FP32 scale per 1x128 or 128x128 block
"""
