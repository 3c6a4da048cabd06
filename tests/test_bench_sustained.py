"""The sustained-load benchmark's bookkeeping (its timing runs on the GPU only): the clock log's parsing and
window summaries, the ratios, and its argument errors, raised before anything is timed."""

import random

import pytest

from te_fused_moe import bench_sustained as bs


def test_parse_sample_reads_clock_power_and_reasons():
    mhz, watts, reasons = random.randint(300, 2000), round(random.uniform(60, 700), 2), random.choice([0, 4, 0x84])
    assert bs.parse_sample(f"{mhz}, {watts}, 0x{reasons:016x}\n", 12.5) == (12.5, mhz, watts, reasons)
    assert bs.parse_sample("clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active", 0.0) is None
    assert bs.parse_sample("1980, [N/A], 0x0", 0.0) is None
    assert bs.parse_sample("1980, 120.0", 0.0) is None


def test_summarize_keeps_the_window_only():
    rng = random.Random()
    inside = [(1.0 + i * 0.05, rng.uniform(1200, 1980), rng.uniform(400, 700), rng.choice([0, 0x4, 0x80]))
              for i in range(20)]
    outside = [(0.5, 300.0, 70.0, 0x4), (3.0, 300.0, 70.0, 0x4)]
    got = bs.summarize(outside[:1] + inside + outside[1:], 1.0, inside[-1][0])
    assert got["samples"] == len(inside)
    assert got["sm_mhz"] == pytest.approx(sum(s[1] for s in inside) / len(inside))
    assert got["sm_mhz_min"] == min(s[1] for s in inside)
    assert got["power_w"] == pytest.approx(sum(s[2] for s in inside) / len(inside))
    assert got["power_capped"] == pytest.approx(sum(s[3] != 0 for s in inside) / len(inside))
    assert bs.summarize(inside, 10.0, 11.0) is None


def test_ratios_are_baseline_over_fast():
    fast, slow = random.uniform(10, 20), random.uniform(20, 30)
    got = bs.ratios({"fused": fast, "unfused": slow}, bs.parse_pairs("fused:unfused,unfused:fused"))
    assert got == {"fused:unfused": pytest.approx(slow / fast), "unfused:fused": pytest.approx(fast / slow)}
    with pytest.raises(ValueError, match="--ratios: 'other'"):
        bs.ratios({"fused": fast}, [("fused", "other")])


@pytest.mark.parametrize("text", ["fused", "fused:", ":unfused", "a:b,c"])
def test_parse_pairs_rejects_malformed_pairs(text):
    with pytest.raises(ValueError, match="--ratios"):
        bs.parse_pairs(text)


def test_unknown_names_fail_before_anything_is_timed():
    with pytest.raises(ValueError, match="--impls: unknown \\['no_such_impl'\\]"):
        bs.run(["mxfp8_fused", "no_such_impl"], [], "dsv3-e32", 1, 0.0, 1)
    with pytest.raises(ValueError, match="--ratios: 'bf16_unfused' is not among"):
        bs.run(["mxfp8_fused"], [("mxfp8_fused", "bf16_unfused")], "dsv3-e32", 1, 0.0, 1)


def test_clock_log_without_nvidia_smi_is_empty(monkeypatch):
    monkeypatch.setattr(bs.shutil, "which", lambda name: None)
    log = bs.ClockLog()
    assert log.samples == [] and log.window(0.0, 1e9) is None
    log.close()


def test_training_step_recomputes_gradients_from_fresh_copies():
    """``bench.training_step``: the parameters are leaf copies (the inputs stay untouched), and each step clears
    their gradients before its backward, so two steps leave one step's gradients, not their sum."""
    import torch

    from te_fused_moe import bench

    T, H, F, E = 12, 8, 6, 3
    inputs = {"x": torch.randn(T, H, dtype=torch.float64), "w1": torch.randn(E, F, H, dtype=torch.float64),
              "w2": torch.randn(E, H, F, dtype=torch.float64), "counts": torch.tensor([5, 0, 7]),
              "dy": torch.randn(T, H, dtype=torch.float64)}

    def mlp(x, counts, w1, w2, activation):
        assert activation == "gelu"
        rows = torch.repeat_interleave(torch.arange(E), counts)
        h = torch.einsum("th,tfh->tf", x, w1[rows])
        return torch.einsum("tf,thf->th", torch.nn.functional.gelu(h), w2[rows])

    forward, step, params = bench.training_step(mlp, inputs, "gelu")
    assert all(p.is_leaf and p.requires_grad and p.data_ptr() != inputs[k].data_ptr()
               for p, k in zip(params, ("x", "w1", "w2")))
    step()
    once = [p.grad.clone() for p in params]
    step()
    for p, g in zip(params, once):
        assert torch.equal(p.grad, g)
    assert params[1].grad[1].abs().sum() == 0 and params[1].grad[0].abs().sum() > 0  # expert 1 got no tokens
    torch.testing.assert_close(forward(), mlp(*(inputs[k] for k in ("x", "counts", "w1", "w2")), "gelu"))
