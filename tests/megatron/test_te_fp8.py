"""Transformer Engine's flags where TE does not run (CPU CI): the main job's, the Megatron-LM bench's,
and DMuon's FP8-param guard. Each refusal names the flag; what runs on the H200 is tests/gpu."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from tests import ROOT
sys.path.insert(0, os.path.join(ROOT, "bench"))
import megatron_lm_compare  # noqa: E402  (bench/megatron_lm_compare.py)

from megatron_dmuon.megatron.train import checks as job_checks  # noqa: E402
from megatron_dmuon.megatron.train.args import parse_args  # noqa: E402
from megatron_dmuon.megatron.train.summary import layers_label  # noqa: E402


def _error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine needs a CUDA GPU and Transformer Engine"),
    (["--fp8-format", "hybrid"], "--fp8-format needs Transformer Engine's layers (--transformer-impl transformer_engine)"),
    (["--gradient-accumulation-fusion"], "--gradient-accumulation-fusion needs Transformer Engine's layers"),
    (["--fp8-param-gather"], "--fp8-param-gather keeps FP8 params: it needs --fp8-format"),
], ids=["te_without_te", "fp8_without_te", "wgrad_fusion_without_te", "fp8_params_without_fp8"])
def test_main_job_refuses_te_flags_where_te_does_not_run(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _error(argv, capsys)
    assert message in err and err.count("error:") == 1, err


@pytest.mark.parametrize("argv,message", [
    (["--fp8-format", "hybrid"], "--fp8-format needs --bf16"),
    (["--fp8-format", "hybrid", "--bf16", "--hidden-size", "72", "--num-attention-heads", "4"],
     "--fp8-format: --hidden-size = 72 must be a multiple of 16"),
    (["--fp8-format", "hybrid", "--bf16", "--seq-length", "127", "--micro-batch-size", "3", "--global-batch-size", "6"],
     "--micro-batch-size x --seq-length = 381 must be a multiple of 16"),
    (["--gradient-accumulation-fusion"], "needs Apex's fused_weight_gradient_mlp_cuda"),
], ids=["fp8_without_bf16", "fp8_hidden_72", "fp8_tokens_381", "wgrad_fusion_without_apex"])
def test_main_job_checks_fp8_and_fusion_where_te_imports(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(job_checks, "transformer_engine_importable", lambda: True)
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", None)  # (an import of it fails)
    err = _error(argv, capsys)
    assert message in err and err.count("error:") == 1, err


def test_main_job_layers_default_to_te_where_it_imports(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parse_args([]).transformer_impl == "local"  # (no TE here)
    monkeypatch.setattr(job_checks, "transformer_engine_importable", lambda: True)
    args = parse_args(["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"])
    assert args.transformer_impl == "transformer_engine"
    assert layers_label(args) == "TE fp8 hybrid/tensorwise fp8-params"


def test_megatron_lm_bench_layer_flags():
    args = SimpleNamespace(transformer_impl="auto", fp8_format=None, fp8_recipe="delayed", fp8_param_gather=False,
                           gradient_accumulation_fusion=None)
    megatron_lm_compare.resolve_layers(args)
    te_here = megatron_lm_compare.te_available()
    assert args.transformer_impl == ("transformer_engine" if te_here else "local")
    local = SimpleNamespace(**{**vars(args), "transformer_impl": "local", "gradient_accumulation_fusion": False})
    assert megatron_lm_compare.layer_flags(local) == megatron_lm_compare.NO_TE
    te = SimpleNamespace(transformer_impl="transformer_engine", fp8_format="hybrid", fp8_recipe="tensorwise",
                         fp8_param_gather=True, gradient_accumulation_fusion=False)
    assert megatron_lm_compare.layer_flags(te) == [
        "--transformer-impl", "transformer_engine", "--no-gradient-accumulation-fusion", "--fp8-format", "hybrid",
        "--fp8-recipe", "tensorwise", "--fp8-param-gather"]
    assert megatron_lm_compare.precision_label(te) == "TE layers, fp8 hybrid/tensorwise + --fp8-param-gather"
    te.gradient_accumulation_fusion = True  # Megatron-LM's default: no flag
    assert "--no-gradient-accumulation-fusion" not in megatron_lm_compare.layer_flags(te)
    with pytest.raises(SystemExit, match="--fp8-format needs Transformer Engine"):
        megatron_lm_compare.resolve_layers(SimpleNamespace(**{**vars(local), "fp8_format": "hybrid"}))
    with pytest.raises(SystemExit, match="--fp8-param-gather needs --fp8-format"):
        megatron_lm_compare.resolve_layers(SimpleNamespace(**{**vars(te), "fp8_format": None}))


def test_fp8_param_gather_without_fp8_params_is_refused():
    """A DDP whose model config asks for FP8 params but holds none would train the bf16-param run
    under the flag's name: DMuon's DDP refuses it by name (and says what it holds otherwise)."""
    from megatron_dmuon.megatron.te_fp8 import fp8_param_summary

    ddp = SimpleNamespace(module=torch.nn.Linear(16, 16), buffers=[], expert_parallel_buffers=[])
    with pytest.raises(ValueError, match="--fp8-param-gather: the model holds 0 TE FP8 params"):
        fp8_param_summary(ddp, SimpleNamespace(fp8="hybrid", fp8_param=True))
    assert fp8_param_summary(ddp, SimpleNamespace(fp8="hybrid", fp8_param=False)) is None
    assert fp8_param_summary(ddp, SimpleNamespace(fp8=None, fp8_param=False)) is None
