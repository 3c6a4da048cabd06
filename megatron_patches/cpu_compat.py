"""Run Megatron's MoE layer on a CPU-only machine (tests, the CPU-tiny pretrain config).

megatron-core's router and token dispatchers call ``torch.cuda.current_device()``,
``torch.cuda.Stream()``, ``torch.cuda.stream(...)`` and events unconditionally (the all-to-all
dispatcher copies counts to the host on a side stream), and forks CUDA RNG streams around
dropout. On a machine without CUDA, :func:`cpu_cuda_shim` stands in for those calls: the
"current device" is the CPU, streams, events and RNG forks are no-ops (CPU work is already
ordered; the one CPU generator is used), and all-to-all split sizes are passed as lists. It does nothing where CUDA is available and
undoes itself on exit. Never used on the GPU path.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class _NoOpEvent:
    def record(self, stream=None):
        return None

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True


class _NoOpStream:
    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event or _NoOpEvent()

    def synchronize(self):
        return None

    def query(self):
        return True


_STREAM = _NoOpStream()


@contextlib.contextmanager
def cpu_cuda_shim() -> Iterator[None]:
    """Patch the few ``torch.cuda`` calls Megatron's MoE path makes (no-op where CUDA exists)."""
    define_missing_te_names()
    if torch.cuda.is_available():
        yield
        return
    replacements = {
        "current_device": lambda: torch.device("cpu"),
        "Stream": lambda *a, **k: _STREAM,
        "Event": lambda *a, **k: _NoOpEvent(),
        "current_stream": lambda *a, **k: _STREAM,
        "stream": lambda s=None: contextlib.nullcontext(),
        "is_current_stream_capturing": lambda: False,
        "synchronize": lambda *a, **k: None,
    }
    saved = {name: getattr(torch.cuda, name) for name in replacements}
    saved_all_to_all = torch.distributed.all_to_all_single
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    had_own_fork = "fork" in vars(tracker)
    saved_fork = tracker.fork
    try:
        for name, value in replacements.items():
            setattr(torch.cuda, name, value)
        torch.distributed.all_to_all_single = _splits_as_lists(saved_all_to_all)
        # Megatron forks its CUDA RNG streams around dropout; on CPU the one torch RNG is used.
        tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        torch.distributed.all_to_all_single = saved_all_to_all
        if had_own_fork:
            tracker.fork = saved_fork
        else:
            del tracker.fork


def _splits_as_lists(all_to_all_single):
    """On GPU the all-to-all dispatcher turns its split sizes into host numpy arrays on the D2H
    stream; on CPU they stay tensors, which ``all_to_all_single`` rejects. Pass them as lists."""

    def wrapper(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        def as_list(splits):
            return splits.tolist() if hasattr(splits, "tolist") else splits

        return all_to_all_single(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs)

    return wrapper


def define_missing_te_names() -> None:
    """megatron-core 0.16.1 reads ``te_general_gemm`` in the router's gating GEMM but only defines it
    when Transformer Engine imports; without TE every MoE forward raises ``NameError``. Define it as
    ``None`` (Megatron's own "no TE" value, which selects its ``torch.mm`` path). Idempotent; a
    no-op on versions that define it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
