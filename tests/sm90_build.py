"""Offline sm_90a builds of Triton kernels on a CPU machine (no GPU): Triton's compiler plus the
ptxas / cuobjdump / nvdisasm in the Triton wheel. Used by the interpreter tests to catch GPU compile
errors and register spills before any device time is spent. Needs TRITON_INTERPRET unset."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

TOOLS = ("ptxas", "cuobjdump", "nvdisasm")


def tools_dir() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def have_tools() -> bool:
    return all(os.path.exists(os.path.join(tools_dir(), b)) for b in TOOLS)


def _signature(fn, types: dict, consts: dict):
    """The compile signature (arguments not in ``types`` are i32) and the divisibility attrs: a real
    launch specialises pointers and 16-divisible strides/sizes on divisibility by 16 (vectorised
    accesses); without these hints the build looks far more register-bound."""
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(types)
    sig.update({c: "constexpr" for c in consts})
    attrs = {}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            continue
        if isinstance(sig[n], tuple):  # a tuple argument: its pointers, at (argument, member)
            attrs.update({(i, j): [["tt.divisibility", 16]] for j, t in enumerate(sig[n]) if t.startswith("*")})
        elif sig[n].startswith("*") or n.startswith("stride") or n in ("N", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def with_constexpr_defaults(fn, consts: dict) -> dict:
    """``consts`` plus the defaults of ``fn``'s constexpr parameters it leaves out: a launch gets those defaults,
    but a build from :class:`ASTSource` would otherwise take them as i32 arguments and compile every branch on them."""
    import inspect

    defaults = {p.name: p.default for p in fn.params
                if p.is_constexpr and p.default is not inspect.Parameter.empty and p.name not in consts}
    return {**defaults, **consts}


def _options(maxnreg, **options) -> dict:
    """Compile options, with the launch register cap ``maxnreg`` where one is given."""
    return options if maxnreg is None else dict(options, maxnreg=maxnreg)


def build_sm90(fn, types: dict, consts: dict, num_warps: int = 8, num_stages: int = 4, maxnreg=None) -> dict:
    """Compiles jit function ``fn`` for sm_90a (arguments not in ``types`` are i32, ``consts`` are
    constexprs), under a launch register cap ``maxnreg`` if given. Returns :func:`analyze` of the build."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = with_constexpr_defaults(fn, consts)
    sig, attrs = _signature(fn, types, consts)
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=_options(maxnreg, num_warps=num_warps, num_stages=num_stages))
    return analyze(k)


def build_gluon_sm90(fn, types: dict, consts: dict, num_warps: int, maxnreg=None) -> dict:
    """:func:`build_sm90` for a Gluon kernel (tensor-descriptor types from
    ``triton.runtime.jit.mangle_type`` of a host descriptor), under a launch register cap ``maxnreg``
    if given (warp-specialised kernels)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = with_constexpr_defaults(fn, consts)
    sig, attrs = _signature(fn, types, dict(consts, num_warps=num_warps))
    k = triton.compile(GluonASTSource(fn, sig, dict(consts, num_warps=num_warps), attrs),
                       target=GPUTarget("cuda", 90, 32), options=_options(maxnreg, num_warps=num_warps))
    return analyze(k)


def analyze(k) -> dict:
    """A compiled kernel's stack (spill) bytes, its registers per thread, its SASS instruction count, its
    IEEE division slow-path checks (``fchk``) and FP32 -> FP8x2 conversions (``f2fp``), its proxy fences
    (``fence_async``), its FP8 (``qgmma``) and 16-bit (``hgmma``) wgmma counts, its warp-level 16-bit MMAs
    (``hmma``: mma.sync), how many FP8 wgmmas share a commit group with the next one (``qgmma_grouped``: 0 when
    ptxas serialised them) and the waits that leave one group in flight (``wait_le1``), its dynamic shared memory
    bytes and, when it has wgmma, whether its K loop was found and the spill loads/stores inside it; the scalar
    int32 loads in its TTGIR."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([os.path.join(tools_dir(), "cuobjdump"), "--dump-resource-usage", path],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools_dir(), "nvdisasm"), path], capture_output=True, text=True,
                              check=True).stdout.splitlines()
        encoded = subprocess.run([os.path.join(tools_dir(), "cuobjdump"), "-sass", path], capture_output=True,
                                 text=True, check=True).stdout
    out = {"stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
           "registers": int(re.search(r"REG:(\d+)", usage).group(1)), "qgmma": sum("QGMMA" in l for l in sass),
           "hgmma": sum("HGMMA" in l for l in sass), "hmma": sum("HMMA" in l for l in sass),
           "shared": k.metadata.shared,
           "qgmma_grouped": sum("QGMMA" in l and "gsb0" not in l for l in sass),
           "instructions": sum(bool(re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?[A-Z]", l)) for l in sass),
           "fchk": sum("FCHK" in l for l in sass), "f2fp": sum("F2FP" in l for l in sass),
           "wait_le1": sum("WARPGROUP.DEPBAR.LE gsb0, 0x1" in l for l in sass),
           # generic -> async proxy fences (fence.proxy.async): mbarrier init, before TMA writes into shared
           # memory that threads read with ordinary loads, before TMA stores of what threads wrote
           "fence_async": sum("FENCE.VIEW.ASYNC.S" in l for l in sass),
           # register reallocation between warp-specialised partitions: the largest setmaxnreg asked for
           "setmaxnreg_max": max([int(m.group(1), 16) for l in sass
                                  for m in [re.search(r"SETMAXREG\.\w+(?:\.\w+)*\s+(?:U?P\w+,\s*)?0x([0-9a-f]+)", l)]
                                  if m] or [0]),
           # FP32 FMAs, and those that carry the yield hint (see scheduling_hints)
           **scheduling_hints(encoded),
           # scalar int32 loads left in the TTGIR (the persistent kernels' schedule reads) inside loops: a
           # read whose result the compiler dropped is gone from here too
           "scalar_i32_loads_in_loops": _loads_in_loops(k.asm.get("ttgir", ""))}
    # the K loop: from the label that a backward branch after the last wgmma jumps to, to that branch
    mma = [i for i, line in enumerate(sass) if "QGMMA" in line or "HGMMA" in line]
    if mma:
        labels = {m.group(1): i for i, line in enumerate(sass) for m in [re.match(r"\s*\.(L_x_\d+):", line)] if m}
        loop = []
        for i in range(mma[-1], len(sass)):
            m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", sass[i])
            if m and labels.get(m.group(1), len(sass)) < mma[0]:
                loop = sass[labels[m.group(1)]: i + 1]
                break
        out["loop_found"] = bool(loop)
        out["loop_spills"] = sum(("STL" in line) or ("LDL" in line) for line in loop)
    return out


def _loads_in_loops(ttgir: str) -> int:
    """Scalar int32 ``tt.load``s inside ``scf.for`` bodies of a TTGIR listing (regions tracked by their
    opening and closing braces, one op per line)."""
    stack, count = [], 0
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}"):
            if stack:
                stack.pop()
            if not text.rstrip().endswith("{"):
                continue
        if re.search(r"tt\.load %\S+ : !tt\.ptr<i32>", text) and "for" in stack:
            count += 1
        if text.endswith("{"):
            stack.append("for" if "scf.for" in text else "other")
    return count


def scheduling_hints(cuobjdump_sass: str) -> dict:
    """Counts the FFMAs of ``cuobjdump -sass`` output and those whose yield hint is set. Each sm_90
    instruction is two 64-bit words; the high word's bits 41-63 are the scheduling controls ptxas sets
    (stall cycles, yield, dependency barriers, operand reuse). Bit 45 clear lets the warp scheduler
    switch warps after the instruction: ptxas >= 12.9 clears it on every other FFMA of a long run so
    that another warp (the one issuing the next wgmma) gets issue slots while one promotes."""
    ffma = ffma_yield = 0
    lines = cuobjdump_sass.splitlines()
    for first, second in zip(lines, lines[1:]):
        if not re.search(r"\bFFMA\b", first):
            continue
        high = re.search(r"/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$", second)
        if high is None:
            continue
        ffma += 1
        ffma_yield += ((int(high.group(1), 16) >> 45) & 1) == 0
    return {"ffma": ffma, "ffma_yield": ffma_yield}


def report_in_subprocess(module: str, timeout: int = 600, env: dict | None = None) -> dict:
    """``module.sm90_build_report()`` run in a fresh process with the interpreter off (a process
    that imported the Triton backend under ``TRITON_INTERPRET=1`` cannot compile for the GPU)."""
    import json
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")])
    code = f"import json, {module} as t; print('SM90' + json.dumps(t.sm90_build_report()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SM90")]
    assert proc.returncode == 0 and lines, proc.stderr[-5000:]
    return json.loads(lines[-1][4:])
