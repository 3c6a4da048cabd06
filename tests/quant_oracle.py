"""Independent element-by-element oracle for the quantizers (pure Python, no torch).

Written differently from ``te_fused_moe.quantize`` on purpose: float32 arithmetic is emulated by
rounding exact Python (double) results with ``math.frexp``; FP8/FP4 rounding searches the sorted
list of every representable value of the format with explicit nearest / ties-to-even-code
breaking; E8M0 searches powers of two. The rules are TE's, as listed in the quantizer modules'
docstrings (satfinite casts, E8M0 rounded up, NaN skipped by amax, ...). Use on small tensors.
"""

from __future__ import annotations

import bisect
import math

FLT_MAX = (2.0 - 2.0**-23) * 2.0**127
NAN = float("nan")
INF = float("inf")


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (ties to even), overflowing to ±inf."""
    if x != x or x in (INF, -INF) or x == 0.0:
        return x
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    # float32 keeps 24 significant bits; below 2**-126 the spacing stays 2**-149.
    quantum_exp = max(e - 24, -149)
    q = math.ldexp(1.0, quantum_exp)
    r = math.copysign(round(x / q) * q, x)  # round(): half to even (returns an int: keep the sign)
    if abs(r) > FLT_MAX:
        return math.copysign(INF, x)
    return r


def f32_mul(a: float, b: float) -> float:
    return f32(a * b)  # a*b is exact in double for float32 operands (when finite)


def f32_div(a: float, b: float) -> float:
    if b == 0.0:
        if a == 0.0 or a != a:
            return NAN
        return math.copysign(INF, a) * math.copysign(1.0, b)
    return f32(a / b)  # double rounding of a quotient of floats is innocuous (53 >= 2*24+2)


class Format:
    """Every bit code of a small float format and its value."""

    def __init__(self, name, ebits, mbits, bias, nan_codes, inf_codes=()):
        self.name, self.ebits, self.mbits, self.bias = name, ebits, mbits, bias
        self.sign = 1 << (ebits + mbits)
        self.values = {}
        for code in range(self.sign):
            if code in nan_codes:
                continue
            if code in inf_codes:
                continue
            exp_field, man = code >> mbits, code & ((1 << mbits) - 1)
            if exp_field == 0:
                v = man * 2.0 ** (1 - bias - mbits)
            else:
                v = (1 + man / 2.0**mbits) * 2.0 ** (exp_field - bias)
            self.values[code] = v
        self.max = max(self.values.values())
        self.max_code = max(c for c, v in self.values.items() if v == self.max)
        self.sorted = sorted((v, c) for c, v in self.values.items())
        self.sorted_values = [v for v, _ in self.sorted]
        self.nan_codes = set(nan_codes)

    def value(self, code: int) -> float:
        mag = code & (self.sign - 1)
        if mag in self.nan_codes:
            return NAN
        if mag not in self.values:
            return math.copysign(INF, -1.0 if code & self.sign else 1.0)
        v = self.values[mag]
        return -v if code & self.sign else v

    def round_code(self, x: float) -> int:
        """Nearest representable (ties -> even code), saturating; NaN -> canonical NaN or +max."""
        if x != x:
            return 0x7F if self.nan_codes else self.max_code
        negative = math.copysign(1.0, x) < 0
        a = abs(x)
        if a >= self.max:
            code = self.max_code
        else:
            i = bisect.bisect_left(self.sorted_values, a)
            if self.sorted_values[i] == a:
                code = self.sorted[i][1]
            else:
                (lo, lo_code), (hi, hi_code) = self.sorted[i - 1], self.sorted[i]
                if a - lo < hi - a:
                    code = lo_code
                elif hi - a < a - lo:
                    code = hi_code
                else:
                    code = lo_code if lo_code % 2 == 0 else hi_code
        return code | self.sign if negative else code


E4M3 = Format("e4m3", 4, 3, 7, nan_codes=(0x7F,))
E5M2 = Format("e5m2", 5, 2, 15, nan_codes=(0x7D, 0x7E, 0x7F), inf_codes=(0x7C,))
E2M1 = Format("e2m1", 2, 1, 1, nan_codes=())
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def e8m0_round_up(v: float) -> int:
    """Biased exponent of the smallest power of two >= v, within [2^-127, 2^127]; NaN -> 255."""
    if v != v:
        return 255
    if v == 0.0:
        return 0
    for k in range(-127, 128):
        if 2.0**k >= v:
            return k + 127
    return 254


def amax(values) -> float:
    best = 0.0
    for v in values:
        if v == v and abs(v) > best:
            best = abs(v)
    return best


# ----------------------------------------------------------------------------------------- MXFP8
def mxfp8_block(values, fmt_name):
    """(list of data codes, E8M0 scale code) of one block of float32 values."""
    fmt = FORMATS[fmt_name]
    rcp = f32(1.0 / fmt.max)
    code = e8m0_round_up(f32_mul(amax(values), rcp))
    multiplier = NAN if code == 255 else 2.0 ** (127 - code)
    return [fmt.round_code(f32_mul(v, multiplier)) for v in values], code


def mxfp8_value(code, scale_code, fmt_name):
    return FORMATS[fmt_name].value(code) * (NAN if scale_code == 255 else 2.0 ** (scale_code - 127))


# ----------------------------------------------------------------------------------------- NVFP4
def nvfp4_global(global_amax: float):
    """(S_enc, S_dec) of a float32 global amax."""
    s_enc = f32_div(448.0 * 6.0, global_amax)
    s_enc = min(s_enc, FLT_MAX)
    if global_amax == 0.0 or s_enc == 0.0:
        s_enc = 1.0
    return s_enc, f32_div(1.0, s_enc)


def sr_e2m1_code(x: float, rbits: int) -> int:
    """TE's software stochastic rounding onto E2M1 with 8 random bits."""
    u = rbits / 256.0
    a = abs(x)

    def step(m):
        return 2.0 if m >= 4.0 else (1.0 if m >= 2.0 else 0.5)

    if a != a:
        q = 6.0
    elif a == INF:
        q = 6.0
    else:
        t = f32(a + u * step(a))
        q = min(math.floor(t / step(t)) * step(t), 6.0)
    negative = (x == x) and math.copysign(1.0, x) < 0
    code = E2M1.round_code(q)  # q is on the grid: exact
    return code | 0x8 if negative else code


def nvfp4_block(values, block_amax, s_enc, s_dec, rbits=None):
    """(list of E2M1 codes, E4M3 scale code) of one block; ``block_amax`` given so that a 16x16
    tile can share it."""
    multiplier = f32_mul(s_enc, f32(1.0 / 6.0))
    decode = min(f32_mul(block_amax, multiplier), FLT_MAX)
    scale_code = E4M3.round_code(decode)
    scale = E4M3.value(scale_code)
    encode = min(f32_div(1.0, f32_mul(scale, s_dec)), FLT_MAX)
    codes = []
    for i, v in enumerate(values):
        y = f32_mul(v, encode)
        codes.append(E2M1.round_code(y) if rbits is None else sr_e2m1_code(y, rbits[i]))
    return codes, scale_code


def nvfp4_value(code, scale_code, global_amax):
    """TE's dequantize_nvfp4 in float32: e2m1 * (scale * amax * fp32(1/2688))."""
    factor = f32(1.0 / 2688.0)
    return f32_mul(E2M1.value(code), f32_mul(f32_mul(E4M3.value(scale_code), global_amax), factor))


# ------------------------------------------------------------------------------------ FP8 block
def fp8_block_scale(block_amax, fmt_name, power_2, value_for_inf=FLT_MAX):
    fmt = FORMATS[fmt_name]
    if block_amax == 0.0 or block_amax == INF or block_amax != block_amax:
        return 1.0
    scale = f32_div(fmt.max, block_amax)
    if scale == INF:
        scale = value_for_inf
    if power_2:
        _, e = math.frexp(scale)
        scale = 2.0 ** (e - 1)
    return scale


def fp8_block_block(values, block_amax, fmt_name, power_2, value_for_inf=FLT_MAX):
    """(list of codes, float32 scale_inv) of one block."""
    fmt = FORMATS[fmt_name]
    scale = fp8_block_scale(block_amax, fmt_name, power_2, value_for_inf)
    return [fmt.round_code(f32_mul(v, scale)) for v in values], f32_div(1.0, scale)


# ------------------------------------------------------------------------------------- Hadamard
SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def rht_entry(i: int, j: int) -> float:
    """Entry (i, j) of diag(signs) · H16 / 4, H[i][j] = (-1)^popcount(i & j)."""
    return SIGNS[i] * (-1.0) ** bin(i & j).count("1") / 4.0


def rht_run(v):
    """16 values -> v · M (exact sums via math.fsum)."""
    return [math.fsum(v[i] * rht_entry(i, j) for i in range(16)) for j in range(16)]
