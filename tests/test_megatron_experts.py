"""FusedExpertsMLP (fused-reference backend) against Megatron's SequentialMLP on identical weights:
alone, inside a real MoELayer (router + alltoall / allgather dispatchers), and via the swap helper.
CPU, world size 1 (gloo)."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_testing import (  # noqa: E402
    build_experts,
    build_moe_layer,
    copy_expert_weights,
    expert_grads,
    init_model_parallel,
    make_config,
    moe_layer_step,
)
from moe_reference import activation_fp64, rel_err  # noqa: E402

TOL = 2e-5  # FP32 on both sides; only the summation order differs


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    from megatron_patches.cpu_compat import cpu_cuda_shim

    init_model_parallel(ep=1, etp=1)
    with cpu_cuda_shim():  # Megatron's router/dispatchers call torch.cuda unconditionally
        yield


def _pair(activation, bias=False, **extra):
    seq = build_experts(make_config("sequential", activation=activation, bias=bias, **extra), 4)
    fused = build_experts(make_config("fused-reference", activation=activation, bias=bias, **extra), 4)
    copy_expert_weights(seq, fused)
    return seq, fused


def _fp64_reference(fused, x, counts, probs, dy, activation):
    """FP64 per-expert loop with TEGroupedMLP's bias semantics (fc2 bias scaled by the prob).

    Used where SequentialMLP cannot be: megatron-core's MLP adds the prob-scaled fc2 bias in place
    on a view, which autograd rejects at world size 1 on CPU."""
    leaves = [t.detach().double().requires_grad_(True) for t in
              (x, probs, fused.linear_fc1.weight, fused.linear_fc1.bias, fused.linear_fc2.weight, fused.linear_fc2.bias)]
    xd, pd, w1, b1, w2, b2 = leaves
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = xd[start:start + n] @ w1[e].T + b1[e]
        a = activation_fp64(activation, h, limit=7.0) * pd[start:start + n, None]
        rows.append(a @ w2[e].T + b2[e] * pd[start:start + n, None])
        start += n
    y = torch.cat(rows)
    y.backward(dy.double())
    grads = {}
    for lin, kind, leaf in (("linear_fc1", "weight", w1), ("linear_fc1", "bias", b1),
                            ("linear_fc2", "weight", w2), ("linear_fc2", "bias", b2)):
        for i in range(leaf.shape[0]):
            grads[(lin, kind, i)] = leaf.grad[i]
    return y.detach(), xd.grad, pd.grad, grads


def _run(module, x, counts, probs, dy):
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    y, bias = module(x, counts, probs)
    assert bias is None
    y.backward(dy)
    return y.detach(), x.grad, probs.grad, expert_grads(module)


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("geglu", False), ("gpt_oss_swiglu", True),
                                             ("srelu", False), ("swiglu", True)])
def test_experts_match_sequential(activation, bias):
    from megatron_patches.experts import FusedExpertsMLP

    seq, fused = _pair(activation, bias=bias)
    assert isinstance(fused, FusedExpertsMLP) and fused.backend == "reference"
    if bias:
        with torch.no_grad():  # Megatron zero-initialises biases; make them count
            fused.linear_fc1.bias.normal_()
            fused.linear_fc2.bias.normal_()
    g = torch.Generator().manual_seed(torch.randint(1 << 30, (1,)).item())
    tokens = 37
    x = torch.randn(tokens, 16, generator=g) * 2.0  # big enough to hit GPT-OSS's clamp
    counts = torch.tensor([9, 0, 17, 11])  # an expert with no tokens
    probs = torch.rand(tokens, generator=g) + 0.05
    dy = torch.randn(tokens, 16, generator=g)
    if bias:
        y_s, dx_s, dp_s, gw_s = _fp64_reference(fused, x, counts, probs, dy, activation)
    else:
        y_s, dx_s, dp_s, gw_s = _run(seq, x, counts, probs, dy)
    y_f, dx_f, dp_f, gw_f = _run(fused, x, counts, probs, dy)
    assert rel_err(y_f, y_s) < TOL
    assert rel_err(dx_f, dx_s) < TOL
    assert rel_err(dp_f, dp_s) < TOL
    assert gw_s.keys() == gw_f.keys()
    for key in gw_s:
        if gw_s[key].abs().sum() == 0:  # the expert without tokens: zero gradient on both sides
            assert torch.equal(gw_f[key], torch.zeros_like(gw_f[key])), key
        else:
            assert rel_err(gw_f[key], gw_s[key]) < TOL, key


def test_counts_on_cpu_list_or_tensor_give_same_result():
    _, fused = _pair("swiglu")
    x = torch.randn(12, 16)
    probs = torch.rand(12)
    y_tensor, _ = fused(x, torch.tensor([3, 4, 0, 5], dtype=torch.int32), probs)
    y_list, _ = fused(x, [3, 4, 0, 5], probs)
    assert torch.equal(y_tensor, y_list)
    with pytest.raises(TypeError, match="tokens_per_expert"):
        fused(x, "3,4,0,5", probs)


def test_probs_on_input_matches_sequential():
    seq, fused = _pair("swiglu", topk=1, moe_apply_probs_on_input=True, moe_router_pre_softmax=True)
    x = torch.randn(10, 16)
    counts = torch.tensor([2, 3, 1, 4])
    probs = torch.rand(10) + 0.1
    dy = torch.randn(10, 16)
    y_s, dx_s, dp_s, _ = _run(seq, x, counts, probs, dy)
    y_f, dx_f, dp_f, _ = _run(fused, x, counts, probs, dy)
    assert rel_err(y_f, y_s) < TOL and rel_err(dx_f, dx_s) < TOL and rel_err(dp_f, dp_s) < TOL


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_inside_moe_layer(dispatcher):
    from megatron_patches.experts import FusedExpertsMLP
    from megatron.core.transformer.moe.experts import SequentialMLP

    torch.manual_seed(torch.randint(1 << 30, (1,)).item())
    layer_s = build_moe_layer(make_config("sequential", dispatcher=dispatcher))
    layer_f = build_moe_layer(make_config("fused-reference", dispatcher=dispatcher))
    assert isinstance(layer_s.experts, SequentialMLP) and isinstance(layer_f.experts, FusedExpertsMLP)
    layer_f.router.load_state_dict(layer_s.router.state_dict())
    copy_expert_weights(layer_s.experts, layer_f.experts)

    x = torch.randn(6, 3, 16)  # [sequence, batch, hidden]
    dy = torch.randn(6, 3, 16)
    s, f = moe_layer_step(layer_s, x, dy), moe_layer_step(layer_f, x, dy)
    (y_s, dx_s, dr_s, gw_s), (y_f, dx_f, dr_f, gw_f) = (tuple(r.values()) for r in (s, f))
    assert rel_err(y_f, y_s) < TOL
    assert rel_err(dx_f, dx_s) < TOL
    assert rel_err(dr_f, dr_s) < TOL  # router gradient flows through the probs
    for key in gw_s:
        assert rel_err(gw_f[key], gw_s[key]) < TOL or gw_s[key].abs().sum() == 0, key


def test_install_hook_picks_fused_experts():
    import megatron_patches
    from megatron_patches.experts import FusedExpertsMLP
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = make_config("fused-reference")
    spec = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=4, moe_grouped_gemm=False)

    def build():
        import functools

        if isinstance(spec, functools.partial):
            return spec(config=config)
        from megatron.core.transformer.spec_utils import build_module

        return build_module(spec, config=config)

    was_installed = megatron_patches.is_installed()
    megatron_patches.uninstall()
    try:
        assert isinstance(build().experts, SequentialMLP)  # Megatron's own choice without the hook
        megatron_patches.install()
        megatron_patches.install()  # idempotent
        assert isinstance(build().experts, FusedExpertsMLP)
        megatron_patches.uninstall()
        assert isinstance(build().experts, SequentialMLP)
    finally:
        if was_installed:
            megatron_patches.install()


@torch.no_grad()  # megatron-core's MLP adds the fc2 bias in place, which autograd refuses on CPU
def test_swap_and_unswap_keep_weights():
    from megatron_patches import swap_megatron_experts, unswap_megatron_experts
    from megatron.core.transformer.moe.experts import SequentialMLP

    layer = build_moe_layer(make_config("sequential", activation="gpt_oss_swiglu", bias=True))
    original = layer.experts
    for expert in original.local_experts:  # biases start at zero; make them matter
        expert.linear_fc1.bias.normal_()
        expert.linear_fc2.bias.normal_()
    x = torch.randn(5, 2, 16)
    y_before, _ = layer(x)
    report = swap_megatron_experts(layer, impl="fused-reference")
    assert len(report) == 1 and report.entries[0].name == "experts"
    assert report.entries[0].replaced == "SequentialMLP" and "fused-reference" in report.entries[0].by
    y_swapped, _ = layer(x)
    assert rel_err(y_swapped, y_before) < TOL
    assert not any(p is q for p in layer.parameters() for q in original.parameters())  # no duplicates
    layer.experts.linear_fc2.weight.mul_(1.5)  # "training" on the fused weights
    y_trained, _ = layer(x)
    back = unswap_megatron_experts(layer)
    assert len(back) == 1 and layer.experts is original and isinstance(layer.experts, SequentialMLP)
    y_back, _ = layer(x)
    assert rel_err(y_back, y_trained) < TOL and rel_err(y_back, y_before) > 1e-3
    with pytest.raises(ValueError, match="impl"):
        swap_megatron_experts(layer, impl="sequential")


def test_host_counts_get_one_reused_device_copy():
    """Counts handed on the host are copied to the device once per distinct value (no copy, so
    capturable, while they stay the same); counts already on the device are used as they are."""
    from megatron_patches.experts import counts_on_device

    meta = torch.device("meta")  # stands in for the GPU: a device other than the host's
    first = counts_on_device(torch.tensor([3, 0, 5]), meta)
    assert first.device == meta and first.dtype == torch.int64 and first.shape == (3,)
    assert counts_on_device(torch.tensor([3, 0, 5], dtype=torch.int32), meta) is first
    assert counts_on_device([3, 0, 5], meta) is first
    assert counts_on_device([3, 1, 5], meta) is not first
    on_host = torch.tensor([2, 2], dtype=torch.int32)
    assert counts_on_device(on_host, torch.device("cpu")) is on_host
    listed = counts_on_device([4, 1], torch.device("cpu"))
    assert listed.tolist() == [4, 1] and counts_on_device((4, 1), torch.device("cpu")) is listed


def test_inside_moe_layer_drop_and_pad():
    """Megatron's drop-and-pad dispatch (fixed capacity per expert, padding rows with prob 0, the
    dispatcher's static-shape mode) gives the same layer as SequentialMLP."""
    torch.manual_seed(torch.randint(1 << 30, (1,)).item())
    extra = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    layer_s = build_moe_layer(make_config("sequential", **extra))
    layer_f = build_moe_layer(make_config("fused-reference", **extra))
    layer_f.router.load_state_dict(layer_s.router.state_dict())
    copy_expert_weights(layer_s.experts, layer_f.experts)
    seen = []
    layer_f.experts.register_forward_hook(lambda m, inputs, out: seen.append(inputs[1].clone()))
    x = torch.randn(8, 2, 16)
    dy = torch.randn(8, 2, 16)
    s, f = moe_layer_step(layer_s, x, dy), moe_layer_step(layer_f, x, dy)
    (y_s, dx_s, gw_s), (y_f, dx_f, gw_f) = ((r["y"], r["dx"], r["experts"]) for r in (s, f))
    capacity = seen[0]
    assert torch.all(capacity == capacity[0]) and int(capacity[0]) > 0  # every expert gets the capacity
    assert rel_err(y_f, y_s) < TOL and rel_err(dx_f, dx_s) < TOL
    for key in gw_s:
        assert rel_err(gw_f[key], gw_s[key]) < TOL or gw_s[key].abs().sum() == 0, key


@pytest.mark.parametrize("deterministic_mode", [False, True])
def test_deterministic_mode_reaches_the_op(monkeypatch, deterministic_mode):
    """Megatron's ``--deterministic-mode`` (``config.deterministic_mode``) turns on the op's ordered
    reductions (``deterministic=True``), and only it does."""
    from megatron_patches import experts as experts_module

    seen = []
    real_op = experts_module.fused_moe_mlp

    def recording_op(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real_op(*args, **kwargs)

    monkeypatch.setattr(experts_module, "fused_moe_mlp", recording_op)
    fused = build_experts(make_config("fused-reference", deterministic_mode=deterministic_mode), 4)
    x = torch.randn(10, 16)
    counts = torch.tensor([3, 0, 5, 2])
    y, _ = fused(x, counts, torch.rand(10))
    assert seen == [deterministic_mode]
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_host_counts_used_by_a_captured_graph_stay_alive(monkeypatch):
    """A device copy of host counts that a CUDA graph captured is read by every replay: it must
    never be evicted (its memory would be reused while the graph still reads it), and counts first
    seen during capture are refused with a clear error (their host-to-device copy cannot be
    captured). Capture is simulated: the meta device stands in for the GPU."""
    from megatron_patches import experts as experts_module

    meta = torch.device("meta")
    monkeypatch.setattr(experts_module, "_HOST_COUNTS_ON_DEVICE", {})
    monkeypatch.setattr(experts_module, "_HOST_COUNTS_CAPTURED", set())
    warm = experts_module.counts_on_device([7, 1, 2], meta)  # eager warm-up step
    monkeypatch.setattr(experts_module, "_stream_is_capturing", lambda device: True)
    assert experts_module.counts_on_device([7, 1, 2], meta) is warm  # captured by the graph
    with pytest.raises(RuntimeError, match="tokens_per_expert.*captur"):
        experts_module.counts_on_device([9, 9, 9], meta)
    monkeypatch.setattr(experts_module, "_stream_is_capturing", lambda device: False)
    for i in range(2 * experts_module._HOST_COUNTS_CACHE_SIZE):  # later eager steps, other counts
        experts_module.counts_on_device([i, 0, 1], meta)
    assert experts_module.counts_on_device([7, 1, 2], meta) is warm
    assert len(experts_module._HOST_COUNTS_ON_DEVICE) <= experts_module._HOST_COUNTS_CACHE_SIZE + 1


def test_experts_built_from_a_config_without_the_option_still_validate():
    """FusedExpertsMLP put in a layer spec directly, with a plain TransformerConfig (no
    moe_grouped_gemm_impl), defaults to 'fused' and must refuse what 'fused' refuses."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches.experts import FusedExpertsMLP

    plain = dict(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_ffn_hidden_size=24,
                 ffn_hidden_size=24, moe_grouped_gemm=True, use_cpu_initialization=True, gated_linear_unit=True,
                 activation_func=torch.nn.functional.silu, moe_router_topk=2)
    ok = FusedExpertsMLP(4, TransformerConfig(**plain), pg_collection=get_default_pg_collection())
    assert ok.impl == "fused" and ok.activation.name == "swiglu"
    with pytest.raises(ValueError, match="moe_apply_probs_on_input=True needs moe_router_topk=1"):
        FusedExpertsMLP(4, TransformerConfig(**plain, moe_apply_probs_on_input=True),
                        pg_collection=get_default_pg_collection())
