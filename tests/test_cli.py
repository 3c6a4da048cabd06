"""The command line: `te-fused-moe env` tells the truth about this machine; `bench` refuses clearly without a GPU."""

import json

import pytest
import torch

from te_fused_moe import cli
from te_fused_moe.recipes import RECIPES_BY_NAME


def test_env_json_reports_every_recipe_and_the_auto_choice(capsys):
    assert cli.main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["packages"]["torch"] == torch.__version__
    assert report["gpu"]["cuda_available"] == torch.cuda.is_available()
    assert {row["recipe"] for row in report["support"]} == set(RECIPES_BY_NAME)
    for row in report["support"]:
        assert set(row["backends"]) == {"cudnn", "triton", "reference"}
        chosen = row["auto"]
        assert row["backends"][chosen] is True
        # every backend auto passed over before its choice says why, in words
        order = ["cudnn", "triton", "reference"]
        for name in order[: order.index(chosen)]:
            assert isinstance(row["backends"][name], str) and row["backends"][name]
    if not torch.cuda.is_available():
        assert all(row["auto"] == "reference" for row in report["support"])
    # the ptxas Triton builds with, and whether it interleaves the promotions' FFMA yield hints
    from te_fused_moe.backends.triton import ptxas

    used = ptxas.in_use()
    assert report["ptxas"].startswith(f"{used.path} ({used.version}; "), report["ptxas"]
    assert ("interleaves FFMA yield hints" in report["ptxas"]) == used.interleaves_ffma, report["ptxas"]


def test_env_text_names_gpu_and_reasons(capsys):
    assert cli.main(["env"]) == 0
    text = capsys.readouterr().out
    assert "gpu" in text and "backend='auto'" in text
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in text
        assert ("fp8_block kernels         plain GEMMs: triton (the Gluon kernels are written for sm_90 (Hopper); "
                "this is cpu)") in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_without_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--shapes", "qwen3-30b-a3b"])
    assert exit_info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_rejects_unknown_shape(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--shapes", "not-a-shape"])
    assert "--shapes: unknown ['not-a-shape']" in capsys.readouterr().err
