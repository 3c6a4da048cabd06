"""``--cuda-graph`` of scripts/pretrain_moe.py and megatron_patches.cuda_graph, on CPU: argument
plumbing, the config fields each mode sets on the installed megatron-core (and on the other
versions' field sets, emulated), and the clear refusal without CUDA. The graphs themselves only
run on a GPU (not exercised here)."""

import importlib.util
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_patches import cuda_graph  # noqa: E402
from megatron_testing import make_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "cpu_tiny.yaml")
CUDA = torch.device("cuda")  # a device object only; nothing is allocated on it


@pytest.fixture(scope="module")
def launcher():
    spec = importlib.util.spec_from_file_location("pretrain_moe", os.path.join(ROOT, "scripts", "pretrain_moe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flag_parses_and_defaults_to_none(launcher):
    assert launcher.CUDA_GRAPH_MODES == cuda_graph.MODES
    assert launcher.parse_args(["--config", CONFIG]).cuda_graph == "none"
    for mode in cuda_graph.MODES:
        assert launcher.parse_args(["--config", CONFIG, "--cuda-graph", mode]).cuda_graph == mode
    with pytest.raises(SystemExit):
        launcher.parse_args(["--config", CONFIG, "--cuda-graph", "everything"])


@pytest.mark.parametrize("mode", ["local", "full_iteration"])
def test_launcher_refuses_graphs_without_cuda(launcher, mode):
    args = launcher.parse_args(["--config", CONFIG, "--device", "cpu", "--cuda-graph", mode, "--out", "/nonexistent"])
    with pytest.raises(ValueError, match=rf"--cuda-graph {mode} needs CUDA.*got device cpu"):
        launcher.train(args)


def test_none_sets_nothing_anywhere():
    assert cuda_graph.cuda_graph_config_fields("none", torch.device("cpu")) == {}
    with pytest.raises(ValueError, match="cuda_graph: expected one of"):
        cuda_graph.cuda_graph_config_fields("layers", CUDA)


@pytest.mark.parametrize("mode,megatron_layer_graphs", [("local", True), ("full_iteration", False)])
def test_fields_build_a_config_on_the_installed_version(mode, megatron_layer_graphs):
    fields = cuda_graph.cuda_graph_config_fields(mode, CUDA)
    assert fields, "both modes must reach Megatron's config on 0.16 and 0.19"
    config = make_config("fused", **fields)
    assert cuda_graph.uses_megatron_layer_graphs(config) is megatron_layer_graphs
    assert not cuda_graph.uses_megatron_layer_graphs(make_config("fused"))


@pytest.mark.parametrize("choices,mode,expected", [
    # megatron-core 0.19: full_iteration is an impl of its own
    ({"cuda_graph_impl": ("none", "local", "transformer_engine", "full_iteration"), "cuda_graph_scope": None,
      "enable_cuda_graph": None}, "full_iteration", {"cuda_graph_impl": "full_iteration"}),
    # 0.16: a scope of the local impl
    ({"cuda_graph_impl": ("none", "local", "transformer_engine"), "cuda_graph_scope": None,
      "enable_cuda_graph": None}, "full_iteration", {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}),
    ({"cuda_graph_impl": ("none", "local", "transformer_engine"), "cuda_graph_scope": None,
      "enable_cuda_graph": None}, "local", {"cuda_graph_impl": "local"}),
    # older: only the boolean
    ({"enable_cuda_graph": None}, "local", {"enable_cuda_graph": True}),
    ({"enable_cuda_graph": None}, "full_iteration", {}),
])
def test_feature_detection_per_version(monkeypatch, choices, mode, expected):
    monkeypatch.setattr(cuda_graph, "_config_field_choices", lambda: choices)
    assert cuda_graph.cuda_graph_config_fields(mode, CUDA) == expected


def test_local_without_any_field_is_refused(monkeypatch):
    monkeypatch.setattr(cuda_graph, "_config_field_choices", lambda: {})
    with pytest.raises(ValueError, match="--cuda-graph local: this megatron-core has neither"):
        cuda_graph.cuda_graph_config_fields("local", CUDA)


def test_full_iteration_graph_runs_eagerly_during_warmup():
    calls = []

    def step(x):
        calls.append(x)
        return (x * 2,)

    graphed = cuda_graph.FullIterationGraph(step, warmup_steps=2)
    for i in range(2):  # CPU tensors: only the eager warm-up part can run here
        (y,) = graphed(torch.full((3,), float(i + 1)))
        assert torch.equal(y, torch.full((3,), 2.0 * (i + 1)))
    assert len(calls) == 2 and not graphed.captured
    with pytest.raises(ValueError, match="warmup_steps"):
        cuda_graph.FullIterationGraph(step, warmup_steps=0)


def test_steady_state_leaves_out_capture_steps(launcher):
    config = make_config("fused")
    assert launcher.steady_state_start("none", config) == 2
    assert launcher.steady_state_start("full_iteration", config) == 2 + launcher.FULL_ITERATION_WARMUP_STEPS
    assert launcher.steady_state_start("local", config) == 2 + config.cuda_graph_warmup_steps


def test_capacity_factor_flag(launcher):
    args = launcher.parse_args(["--config", CONFIG, "--moe-expert-capacity-factor", "1.25"])
    fields = launcher.capacity_fields(args.moe_expert_capacity_factor)
    assert fields == {"moe_expert_capacity_factor": 1.25, "moe_pad_expert_input_to_capacity": True}
    config = make_config("fused", **fields)  # Megatron accepts the pair with the alltoall dispatcher
    assert config.moe_pad_expert_input_to_capacity and config.moe_expert_capacity_factor == 1.25
    assert launcher.capacity_fields(None) == {}
    with pytest.raises(ValueError, match="--moe-expert-capacity-factor: expected a positive number"):
        launcher.capacity_fields(0.0)


@pytest.mark.parametrize("flag,value", [("--train-iters", "0"), ("--train-iters", "-3"),
                                        ("--moe-timing-iters", "0"), ("--moe-timing-iters", "-1")])
def test_count_flags_refuse_non_positive_values(launcher, capsys, flag, value):
    """0 used to fall back silently to the config's value ('or'), and a negative count ran no steps
    and died dividing by zero after building the model; both are refused while parsing."""
    with pytest.raises(SystemExit):
        launcher.parse_args(["--config", CONFIG, flag, value])
    assert f"{flag}: expected a positive integer, got {value}" in capsys.readouterr().err
    assert getattr(launcher.parse_args(["--config", CONFIG, flag, "2"]), flag[2:].replace("-", "_")) == 2


def test_graph_capture_needs_megatrons_graph_safe_rng_states(monkeypatch):
    from megatron.core.tensor_parallel import random as mrandom

    generators = {"model-parallel-rng": torch.Generator(), "expert-parallel-rng": torch.Generator()}
    monkeypatch.setattr(mrandom, "get_all_rng_states", lambda: generators)
    assert cuda_graph.graph_safe_rng_states() == list(generators.values())
    # the default tracker's plain state tensors would replay frozen inside a graph
    monkeypatch.setattr(mrandom, "get_all_rng_states", lambda: {"model-parallel-rng": torch.get_rng_state()})
    with pytest.raises(RuntimeError, match="use_cudagraphable_rng=True"):
        cuda_graph.graph_safe_rng_states()
