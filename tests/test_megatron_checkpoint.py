"""Checkpoints of FusedExpertsMLP against Megatron's layout (CPU, gloo, world size 1).

* the sharded state dict, once its factories are applied, holds exactly the ShardedTensors /
  ShardedObjects of SequentialMLP (keys, global shapes, offsets, fragmentations, replica ids),
  which TEGroupedMLP also produces by design ("interchangeable with SequentialMLP's");
* a ``dist_checkpointing`` save with ``sequential`` loads into ``fused`` bit-identically and back;
* the plain state dict has TEGroupedMLP's keys (``linear_fc1.weight0..``, ``_extra_state``) and
  loads strictly in both directions;
* optimizer state (torch Adam through Megatron's sharded optimizer state) survives a round trip.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_testing import build_experts, init_model_parallel, make_config  # noqa: E402

PREFIX = "decoder.layers.0.mlp.experts."
LAYER_OFFSETS = ((0, 0, 2),)  # as a TransformerBlock passes for layer 0 of 2 (layout checks)
ONE_LAYER = ((0, 0, 1),)  # a checkpoint must cover every shard, so saves hold a 1-layer model


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    from megatron_patches.cpu_compat import cpu_cuda_shim

    init_model_parallel(ep=1, etp=1)
    with cpu_cuda_shim():  # the async filesystem writer asks for torch.cuda.current_device()
        yield


def _layout(sharded):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    apply_factories(sharded)
    rows = []
    for v in nested_values(sharded):
        rows.append((type(v).__name__, v.key, tuple(getattr(v, "global_shape", ())), tuple(getattr(v, "global_offset", ())),
                     tuple(getattr(v, "axis_fragmentations", ()) or ()), v.replica_id,
                     tuple(v.data.shape) if isinstance(getattr(v, "data", None), torch.Tensor) else None))
    return sorted(rows, key=str)


def _random_weights_(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gpt_oss_swiglu", True), ("srelu", False)])
@pytest.mark.parametrize("singleton", [False, True])
def test_sharded_layout_matches_sequential(activation, bias, singleton):
    seq = build_experts(make_config("sequential", activation=activation, bias=bias), 4)
    fused = build_experts(make_config("fused-reference", activation=activation, bias=bias), 4)
    metadata = {"singleton_local_shards": singleton}
    expected = _layout(seq.sharded_state_dict(PREFIX, LAYER_OFFSETS, dict(metadata)))
    got = _layout(fused.sharded_state_dict(PREFIX, LAYER_OFFSETS, dict(metadata)))
    assert got == expected
    keys = {row[1] for row in got}
    if singleton:
        assert f"{PREFIX}experts.3.linear_fc2.weight" in keys
    else:
        assert keys >= {f"{PREFIX}experts.linear_fc1.weight", f"{PREFIX}experts.linear_fc2.weight"}


def _save_load(src, dst, tmp_path):
    # megatron-core's file writer needs psutil (in the device image; `.ci/run` installs it).
    pytest.importorskip("psutil", reason="megatron.core.dist_checkpointing's writer imports psutil")
    from megatron.core import dist_checkpointing

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save(src.sharded_state_dict(PREFIX, ONE_LAYER), str(ckpt))
    loaded = dist_checkpointing.load(dst.sharded_state_dict(PREFIX, ONE_LAYER), str(ckpt))
    stripped = {k[len(PREFIX):]: v for k, v in loaded.items()}
    result = dst.load_state_dict(stripped, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gpt_oss_swiglu", True)])
def test_dist_checkpoint_round_trip_sequential_fused(activation, bias, tmp_path):
    seq = build_experts(make_config("sequential", activation=activation, bias=bias), 4)
    fused = build_experts(make_config("fused-reference", activation=activation, bias=bias), 4)
    _random_weights_(seq)
    _save_load(seq, fused, tmp_path / "a")
    back = build_experts(make_config("sequential", activation=activation, bias=bias), 4)
    _save_load(fused, back, tmp_path / "b")
    for (i, e_seq), e_back in zip(enumerate(seq.local_experts), back.local_experts):
        assert torch.equal(fused.linear_fc1.weight[i], e_seq.linear_fc1.weight)
        assert torch.equal(fused.linear_fc2.weight[i], e_seq.linear_fc2.weight)
        if bias:
            assert torch.equal(fused.linear_fc1.bias[i], e_seq.linear_fc1.bias)
            assert torch.equal(fused.linear_fc2.bias[i], e_seq.linear_fc2.bias)
        for name, p in e_seq.named_parameters():
            assert torch.equal(dict(e_back.named_parameters())[name], p), name


def _in_memory_save_load(src, dst):
    """dist_checkpointing's contract without its file writer: every saved ShardedTensor is found
    by (key, global offset) and copied into the loader's ShardedTensor, then factories merge."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
        apply_factory_merges,
    )

    saved_sd = src.sharded_state_dict(PREFIX, ONE_LAYER)
    apply_factories(saved_sd)
    store = {(t.key, t.global_offset): t.data.clone() for t in nested_values(saved_sd) if isinstance(t, ShardedTensor)}
    target = dst.sharded_state_dict(PREFIX, ONE_LAYER)
    factories = {k: v for k, v in target.items() if isinstance(v, ShardedTensorFactory)}
    apply_factories(target)
    loaded = {}
    for name, value in target.items():
        def fill(t):
            return store.pop((t.key, t.global_offset)).clone() if isinstance(t, ShardedTensor) else None
        loaded[name] = [fill(t) for t in value] if isinstance(value, list) else fill(value)
    assert not store, f"saved but never requested: {sorted(store)}"
    loaded.update(apply_factory_merges({k: loaded[k] for k in factories}, factories))
    dst.load_state_dict({k[len(PREFIX):]: v for k, v in loaded.items() if v is not None}, strict=False)


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gpt_oss_swiglu", True)])
def test_in_memory_round_trip_without_psutil(activation, bias):
    seq = build_experts(make_config("sequential", activation=activation, bias=bias), 4)
    fused = build_experts(make_config("fused-reference", activation=activation, bias=bias), 4)
    _random_weights_(seq)
    _in_memory_save_load(seq, fused)
    back = build_experts(make_config("sequential", activation=activation, bias=bias), 4)
    _in_memory_save_load(fused, back)
    for i, (e_seq, e_back) in enumerate(zip(seq.local_experts, back.local_experts)):
        assert torch.equal(fused.linear_fc1.weight[i], e_seq.linear_fc1.weight)
        assert torch.equal(fused.linear_fc2.weight[i], e_seq.linear_fc2.weight)
        for (name, p), q in zip(e_seq.named_parameters(), e_back.parameters()):
            assert torch.equal(p, q), name


def test_plain_state_dict_has_te_keys_and_loads_strictly():
    fused = build_experts(make_config("fused-reference", bias=True), 3)
    _random_weights_(fused)
    sd = fused.state_dict()
    expected = {f"linear_fc{j}.{kind}{i}" for j in (1, 2) for kind in ("weight", "bias") for i in range(3)}
    expected |= {"linear_fc1._extra_state", "linear_fc2._extra_state"}
    assert set(sd) == expected
    assert sd["linear_fc1.weight2"].shape == (48, 16) and sd["linear_fc2.weight0"].shape == (16, 24)
    other = build_experts(make_config("fused-reference", bias=True), 3)
    other.load_state_dict(sd, strict=True)
    for a, b in zip(fused.parameters(), other.parameters()):
        assert torch.equal(a, b)
    bad = dict(sd)
    del bad["linear_fc2.weight1"]
    with pytest.raises(RuntimeError, match="linear_fc2.weight1"):
        other.load_state_dict(bad, strict=True)
    bad = dict(sd, **{"linear_fc1.weight0": torch.randn(5, 16)})
    with pytest.raises(RuntimeError, match="linear_fc1.weight0"):
        other.load_state_dict(bad, strict=True)


def test_sequential_state_dict_converts_by_key_rename():
    """SequentialMLP's ``local_experts.<i>.linear_fc1.weight`` is TE's ``linear_fc1.weight<i>``."""
    seq = build_experts(make_config("sequential"), 4)
    _random_weights_(seq)
    renamed = {}
    for key, value in seq.state_dict().items():
        _, i, linear, kind = key.split(".")
        if kind == "weight":
            renamed[f"{linear}.weight{i}"] = value
    fused = build_experts(make_config("fused-reference"), 4)
    fused.load_state_dict(renamed, strict=False)
    x, counts, probs = torch.randn(9, 16), torch.tensor([2, 3, 0, 4]), torch.rand(9)
    with torch.no_grad():
        assert torch.allclose(fused(x, counts, probs)[0], seq(x, counts, probs)[0], rtol=1e-5, atol=1e-6)


def test_optimizer_state_round_trip(tmp_path):
    """Adam's exp_avg/exp_avg_sq go through the same factories (parameter identity is kept)."""
    pytest.importorskip("psutil", reason="megatron.core.dist_checkpointing's writer imports psutil")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    fused = build_experts(make_config("fused-reference"), 4)
    opt = torch.optim.Adam(fused.parameters(), lr=1e-3)
    fused(torch.randn(8, 16), torch.tensor([2, 2, 2, 2]), torch.rand(8))[0].sum().backward()
    opt.step()
    model_sd = fused.sharded_state_dict(PREFIX, ONE_LAYER)
    id_map = get_param_id_to_sharded_param_map(model_sd, fused.parameters())
    assert len(id_map) == 2  # both stacked weights found by identity
    state = opt.state_dict()
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    ckpt = tmp_path / "opt"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save({"optimizer": state}, str(ckpt))

    fresh = build_experts(make_config("fused-reference"), 4)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    fresh(torch.randn(8, 16), torch.tensor([2, 2, 2, 2]), torch.rand(8))[0].sum().backward()
    fresh_opt.step()
    template = fresh_opt.state_dict()
    optim_state_to_sharding_state(template, get_param_id_to_sharded_param_map(
        fresh.sharded_state_dict(PREFIX, ONE_LAYER), fresh.parameters()), exclude_keys=("step",))
    loaded = dist_checkpointing.load({"optimizer": template}, str(ckpt))["optimizer"]
    for pid, st in opt.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][pid][name], st[name]), (pid, name)


def _tiny_gpt(impl, seed):
    import megatron_patches
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    megatron_patches.install()
    config = make_config(impl, activation="swiglu", num_layers=2, moe_layer_freq=[0, 1], normalization="RMSNorm",
                         hidden_dropout=0.0, attention_dropout=0.0, apply_rope_fusion=False,
                         masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
                    vocab_size=64, max_sequence_length=16, position_embedding_type="rope")


def _model_in_memory_save_load(src, dst):
    """Whole-model dist-checkpoint contract, in memory: ShardedTensors matched by (key, offset)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
        apply_factory_merges,
    )

    saved = src.sharded_state_dict()
    apply_factories(saved)
    store = {(t.key, t.global_offset): t.data.detach().clone() for t in nested_values(saved) if isinstance(t, ShardedTensor)}
    saved_keys = {t.key for t in nested_values(saved)}
    target = dst.sharded_state_dict()
    factories = {k: v for k, v in target.items() if isinstance(v, ShardedTensorFactory)}
    apply_factories(target)
    assert {t.key for t in nested_values(target)} == saved_keys  # same checkpoint keys, both directions

    def fill(t):
        if isinstance(t, ShardedTensor):
            return store.pop((t.key, t.global_offset)).clone()
        assert isinstance(t, ShardedObject)
        return t.data

    loaded = {k: [fill(t) for t in v] if isinstance(v, list) else fill(v) for k, v in target.items()}
    assert not store, sorted(store)
    loaded.update(apply_factory_merges({k: loaded[k] for k in factories}, factories))
    dst.load_state_dict(loaded, strict=False)


def test_gpt_model_checkpoint_moves_between_fused_and_sequential():
    """A GPTModel with a dense and a MoE layer: fused -> sequential -> fused gives the same logits."""
    from megatron_patches.cpu_compat import cpu_cuda_shim

    with cpu_cuda_shim():
        fused = _tiny_gpt("fused-reference", seed=1)
        sequential = _tiny_gpt("sequential", seed=2)  # different initial weights
        tokens = torch.randint(0, 64, (2, 16))
        positions = torch.arange(16).expand(2, 16)
        mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
        with torch.no_grad():
            logits_fused = fused(tokens, positions, mask)
            assert (sequential(tokens, positions, mask) - logits_fused).abs().max() > 1e-3
            _model_in_memory_save_load(fused, sequential)
            assert torch.allclose(sequential(tokens, positions, mask), logits_fused, rtol=1e-5, atol=1e-5)
            back = _tiny_gpt("fused-reference", seed=3)
            _model_in_memory_save_load(sequential, back)
            assert torch.allclose(back(tokens, positions, mask), logits_fused, rtol=1e-5, atol=1e-5)
