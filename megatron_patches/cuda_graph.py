"""CUDA graphs for a Megatron training step with the fused experts: the launcher's ``--cuda-graph``.

    none            eager (default)
    local           Megatron's own per-layer graphs (``CudaGraphManager``): config
                    ``cuda_graph_impl="local"`` (older versions: ``enable_cuda_graph=True``); the
                    launcher calls Megatron's ``create_cudagraphs()`` after each step, as Megatron's
                    schedules do
    full_iteration  one graph of the whole forward+backward (optimizer step outside), captured
                    by :class:`FullIterationGraph` after a few eager warm-up steps; the config is
                    told so, in the installed version's words (0.19: ``cuda_graph_impl=
                    "full_iteration"``; 0.16: ``cuda_graph_impl="local"`` with ``cuda_graph_scope=
                    "full_iteration"``), so Megatron's layers do not graph themselves inside it

Which fields exist is detected on ``TransformerConfig``, not from version numbers. Graphs need
CUDA: on another device every mode but ``none`` raises ``ValueError``. The whole-iteration capture
is only possible because the fused experts never read ``tokens_per_expert`` on the host; whether
Megatron's router/dispatcher around them capture is what running it on a GPU shows.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Callable, Dict, Optional, Sequence

import torch

MODES = ("none", "local", "full_iteration")


def _config_field_choices() -> Dict[str, Optional[tuple]]:
    """TransformerConfig's CUDA-graph fields -> their Literal choices (None when not a Literal)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    hints = typing.get_type_hints(TransformerConfig)
    out = {}
    for field in dataclasses.fields(TransformerConfig):
        if field.name in ("cuda_graph_impl", "enable_cuda_graph", "cuda_graph_scope"):
            hint = hints.get(field.name)
            out[field.name] = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
    return out


def cuda_graph_config_fields(mode: str, device: torch.device) -> dict:
    """``TransformerConfig`` fields for ``mode`` on this megatron-core, or ``ValueError`` saying why not."""
    if mode not in MODES:
        raise ValueError(f"cuda_graph: expected one of {list(MODES)}, got {mode!r}")
    if mode == "none":
        return {}
    if torch.device(device).type != "cuda":
        raise ValueError(f"--cuda-graph {mode} needs CUDA (graphs are captured on a GPU), got device "
                         f"{torch.device(device)}; use --cuda-graph none here")
    fields = _config_field_choices()
    impl_choices = fields.get("cuda_graph_impl") or ()
    if mode == "local":
        if "local" in impl_choices:
            return {"cuda_graph_impl": "local"}
        if "enable_cuda_graph" in fields:
            return {"enable_cuda_graph": True}
        raise ValueError("--cuda-graph local: this megatron-core has neither cuda_graph_impl='local' nor "
                         "enable_cuda_graph; expected --cuda-graph none or full_iteration")
    # full_iteration
    if "full_iteration" in impl_choices:
        return {"cuda_graph_impl": "full_iteration"}
    if "local" in impl_choices and "cuda_graph_scope" in fields:
        return {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}
    return {}  # an old megatron-core without the notion: our capture alone


def uses_megatron_layer_graphs(config) -> bool:
    """True where Megatron's per-layer graphs are on (``--cuda-graph local``)."""
    impl = getattr(config, "cuda_graph_impl", "none")
    scope = getattr(config, "cuda_graph_scope", None) or ()
    scope_names = {str(getattr(s, "name", s)) for s in (scope if isinstance(scope, (list, tuple)) else [scope])}
    if impl == "local":
        return "full_iteration" not in scope_names
    return bool(getattr(config, "enable_cuda_graph", False))


def create_megatron_layer_graphs() -> None:
    """What Megatron's schedules call after each forward-backward for ``local`` graphs (records
    the layers' graphs after the warm-up steps; a no-op once they exist)."""
    from megatron.core.transformer.cuda_graphs import create_cudagraphs

    create_cudagraphs()


def side_stream():
    """A context that runs everything on one non-default CUDA stream. Build the model and run every
    step of a ``FullIterationGraph`` under it: the parameters' gradient accumulators (created at the
    first backward, or by DDP's hooks at wrap time) then live on the stream the graph captures on."""
    return torch.cuda.stream(torch.cuda.Stream())


def graph_safe_rng_states() -> list:
    """Megatron's named CUDA RNG states, which a captured graph must advance on every replay.

    Only a tracker seeded with ``model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True)``
    holds them as ``torch.Generator`` objects a graph can register; the default tracker keeps plain
    state tensors, whose streams would replay frozen (the same dropout masks every step)."""
    from megatron.core.tensor_parallel.random import get_all_rng_states

    states = list(get_all_rng_states().values())
    frozen = [type(s).__name__ for s in states if not isinstance(s, torch.Generator)]
    if frozen:
        raise RuntimeError(
            "FullIterationGraph: Megatron's RNG tracker is not graph-safe (its states are "
            f"{sorted(set(frozen))}, not torch.Generator): seed it with "
            "model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True) before building the model")
    return states


class FullIterationGraph:
    """Runs ``step(*inputs) -> outputs`` (forward + backward, no optimizer) eagerly for
    ``warmup_steps`` calls, then captures one call in a ``torch.cuda.CUDAGraph`` and replays it.

    Inputs are copied into static buffers first, so every call may pass new tensors of the same
    shapes; the returned tensors are the graph's static outputs (read or copy them before the next
    call). Gradients land where the eager step puts them (Megatron DDP's grad buffers), zeroed by
    the caller outside the graph.
    """

    def __init__(self, step: Callable[..., Sequence[torch.Tensor]], warmup_steps: int = 2):
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps: expected >= 1 (eager steps before capture), got {warmup_steps}")
        self.step = step
        self.warmup_steps = warmup_steps
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_inputs = None
        self.static_outputs = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *inputs: torch.Tensor):
        self.calls += 1
        if self.calls <= self.warmup_steps:
            return self.step(*inputs)
        if self.graph is None:
            self._capture(inputs)
        for buffer, value in zip(self.static_inputs, inputs):
            buffer.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.static_outputs

    def _capture(self, inputs) -> None:
        self.static_inputs = [t.clone() for t in inputs]
        graph = torch.cuda.CUDAGraph()
        if hasattr(graph, "register_generator_state"):
            # Megatron's named RNG streams (dropout etc.) advance on every replay
            for state in graph_safe_rng_states():
                graph.register_generator_state(state)
        if hasattr(torch.autograd.graph, "set_override_stale_capture_stream"):
            # newer torch: backward nodes recorded on the eager warm-up stream may capture on ours
            torch.autograd.graph.set_override_stale_capture_stream(True)
        torch.cuda.synchronize()
        # Capture on the stream the eager steps ran on (see ``side_stream``): autograd's gradient
        # accumulators remember the stream they were created on, and accumulating from another
        # stream during capture makes the legacy stream wait on the capture, which CUDA refuses.
        # Only when that stream is the default one (which cannot capture) is a new one needed.
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            self.static_outputs = self.step(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = graph
