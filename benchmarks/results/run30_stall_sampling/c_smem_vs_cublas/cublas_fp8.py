"""cuBLAS FP8 (per-tensor scales) at FC1's DSv3 GEMM shape, timed, then one launch for ncu."""
import sys, torch
m, n, k = 32768, 4096, 7168
a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
one = torch.tensor(1.0, device="cuda")
f = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
if "--once" in sys.argv:
    f(); torch.cuda.synchronize(); sys.exit()
for _ in range(3): f()
s, e = torch.cuda.Event(True), torch.cuda.Event(True)
s.record()
for _ in range(20): f()
e.record(); torch.cuda.synchronize()
ms = s.elapsed_time(e) / 20
print(f"cublas fp8 {m}x{n}x{k}: {ms:.3f} ms {2*m*n*k/ms/1e9:.0f} TFLOP/s")
