"""Bad DMuon set-ups fail at start-up with errors that name the flag and the fix."""
import dataclasses

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from megatron_dmuon.megatron.optimizer import DMuonConfig, check_dmuon_config
from megatron_dmuon.planning.owner_layout import ParamItem, plan_owner_layout
from megatron_dmuon.runtime.owner_step import MuonSettings

DIST = DistributedDataParallelConfig(use_distributed_optimizer=True)


def _opt(**kw):
    return OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=kw.pop("dist", True), **kw)


def test_fp16_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="--fp16.*--bf16"):
        check_dmuon_config(_opt(fp16=True), DIST, DMuonConfig())


def test_non_distributed_optimizer_is_rejected():
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        check_dmuon_config(_opt(dist=False), DistributedDataParallelConfig(), DMuonConfig())


def test_gather_then_compute_with_distributed_optimizer_is_rejected():
    with pytest.raises(ValueError, match="gather_then_compute"):
        check_dmuon_config(_opt(), DIST, DMuonConfig(mode="gather_then_compute"))


@pytest.mark.parametrize("muon,match", [
    (MuonSettings(momentum=1.0), "momentum"),
    (MuonSettings(ns_method="svd"), "--dmuon-ns-method"),
    (MuonSettings(ns_steps=0), "--muon-num-ns-steps 0 must be an integer >= 1"),
    (MuonSettings(coefficients="nope"), "nope"),
    (MuonSettings(scale_mode="bogus"), "bogus"),
])
def test_bad_muon_settings(muon, match):
    with pytest.raises(ValueError, match=match):
        check_dmuon_config(_opt(), DIST, DMuonConfig(muon=muon))


def test_unknown_mode():
    with pytest.raises(ValueError, match="--dmuon-mode"):
        check_dmuon_config(_opt(), DIST, DMuonConfig(mode="zero3"))


def test_planner_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size"):
        plan_owner_layout([ParamItem("a", 4, True, 1.0)], 0)
    with pytest.raises(ValueError, match="unique"):
        plan_owner_layout([ParamItem("a", 4, True, 1.0), ParamItem("a", 4, True, 1.0)], 2)


def test_planner_is_deterministic_and_serializable():
    items = [ParamItem(f"m{i}", 64 * (i + 1), True, float((i + 1) ** 3)) for i in range(7)]
    items += [ParamItem("emb", 5000, False)]
    a = plan_owner_layout(items, 3)
    b = plan_owner_layout(items, 3)
    assert a.to_json() == b.to_json()
    assert type(a).from_json(a.to_json()).to_json() == a.to_json()
    # cost-balanced: the heaviest rank carries at most the heaviest single matrix more than the lightest
    assert max(a.rank_cost) - min(a.rank_cost) <= max(it.cost for it in items)


def test_adaptive_schedule_settings():
    import torch

    from megatron_dmuon.algorithms.newton_schulz import newton_schulz
    from megatron_dmuon.algorithms.schedules import QUARTIC_SQUARE_5, QUARTIC_WIDE_4
    from megatron_dmuon.runtime.owner_step import MuonSettings, default_orthogonalizer

    settings = MuonSettings(coefficients="adaptive", ns_dtype=torch.float32)
    DMuonConfig(muon=settings)  # (a config checks its settings as it is built)
    assert settings.ns_schedule(64, 64) == {"coefficients": QUARTIC_SQUARE_5, "steps": 5, "normalisation": "quartic"}
    assert settings.ns_schedule(64, 256) == {"coefficients": QUARTIC_WIDE_4, "steps": 4, "normalisation": "quartic"}
    orth = default_orthogonalizer(settings)
    square = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(0))
    wide = torch.randn(2, 16, 48, generator=torch.Generator().manual_seed(1))
    assert torch.equal(orth(square), newton_schulz(square, QUARTIC_SQUARE_5, steps=5, compute_dtype=torch.float32,
                                                   normalisation="quartic"))
    assert torch.equal(orth(wide), newton_schulz(wide, QUARTIC_WIDE_4, steps=4, compute_dtype=torch.float32,
                                                 normalisation="quartic"))
    with pytest.raises(ValueError, match="leave --muon-num-ns-steps at 5"):
        DMuonConfig(muon=MuonSettings(coefficients="adaptive", ns_steps=7))
    with pytest.raises(ValueError, match="unknown Newton-Schulz coefficient set"):
        DMuonConfig(muon=MuonSettings(coefficients="adaptve"))


def test_ns_launch_settings():
    import torch

    from megatron_dmuon.runtime.owner_step import MatrixInfo, MuonSettings, OwnerMuonAdamW

    with pytest.raises(ValueError, match="--dmuon-ns-launch"):
        DMuonConfig(muon=MuonSettings(ns_launch="graphs"))
    p = torch.nn.Parameter(torch.randn(8, 12))
    with pytest.raises(ValueError, match="pass ns_launch='eager' with it"):
        OwnerMuonAdamW([{"params": [p], "use_muon": True}], lr=0.1, weight_decay=0.0,
                       muon=MuonSettings(ns_launch="graph"), orthogonalizer=lambda x: x)
    # (the launch modes themselves are compared on the GPU: tests/kernels/test_gpu.py; off CUDA
    # every mode runs the same eager calls, so a CPU comparison could not fail)


def _model_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(context_parallel_size=2), "--context-parallel-size"),
    (dict(qk_clip=True, tensor_model_parallel_size=2), "--qk-clip needs --tensor-model-parallel-size 1"),
    (dict(gtp_weight_remat_size=2), "--gtp-weight-remat-size"),
])
def test_unsupported_parallel_layouts_fail_before_any_buffer(kw, match):
    from megatron_dmuon.megatron.ddp import build_dmuon_ddp

    class Untouchable(torch.nn.Module):
        def named_parameters(self, *a, **k):
            raise AssertionError("the model was touched before the layout check")

    with pytest.raises(ValueError, match=match):
        build_dmuon_ddp(_model_config(**kw), DIST, Untouchable())


@pytest.mark.parametrize("kw", [dict(tensor_model_parallel_size=2), dict(expert_model_parallel_size=2, num_moe_experts=4)])
def test_gather_then_compute_is_data_parallel_only(kw):
    from megatron_dmuon.megatron.optimizer import check_model_parallel_config

    with pytest.raises(ValueError, match="gather_then_compute"):
        check_model_parallel_config(_model_config(**kw), "gather_then_compute")
    check_model_parallel_config(_model_config(**kw), "dmuon")  # DMuon itself runs these layouts


def test_optimizer_cuda_graph_is_refused_by_name():
    with pytest.raises(ValueError, match="--optimizer-cuda-graph"):
        check_dmuon_config(_opt(optimizer_cuda_graph=True), DIST, DMuonConfig())


def test_bad_tp_method():
    with pytest.raises(ValueError, match="--dmuon-tp-method"):
        check_dmuon_config(_opt(), DIST, DMuonConfig(muon=MuonSettings(tp_method="scatter")))


def test_muon_settings_defaults_are_megatrons_flag_defaults():
    """One source of Muon defaults: an empty command line of the --muon-* table (Megatron-LM's
    argparse defaults) gives MuonSettings' own defaults; torch.optim.Muon's rule is a named preset."""
    import argparse

    from megatron_dmuon.megatron.flags import add_dmuon_args

    parser = argparse.ArgumentParser()
    add_dmuon_args(parser, validate=False)
    cfg = DMuonConfig.from_args(parser.parse_args([]))
    assert cfg == DMuonConfig() and cfg.muon == MuonSettings(ns_method="auto")
    torch_rule = MuonSettings.torch_muon()
    assert (torch_rule.momentum, torch_rule.nesterov, torch_rule.coefficients, torch_rule.scale_mode) == \
        (0.95, True, "keller", "shape_scaling")


def test_every_mode_has_its_traits_and_one_builder():
    """megatron/modes.py's table covers every --dmuon-mode, the optimizer has one builder per mode,
    and an unknown mode is refused by the flag's name wherever its traits are asked for."""
    from megatron_dmuon.megatron.modes import MODE_TRAITS, MODES, mode_traits, modes_training
    from megatron_dmuon.megatron.optimizer import OPTIMIZER_BUILDERS

    assert MODES == ("dmuon", "gather_then_compute", "megatron_layerwise") and set(OPTIMIZER_BUILDERS) == set(MODES)
    with pytest.raises(ValueError, match=r"--dmuon-mode 'adamw' unknown; valid: dmuon, gather_then_compute, "
                                         r"megatron_layerwise"):
        mode_traits("adamw")
    # only the product mode needs the distributed optimizer and checkpoints; the all-reduce baseline refuses it
    assert [m for m, t in MODE_TRAITS.items() if t.checkpoints] == ["dmuon"]
    assert [m for m, t in MODE_TRAITS.items() if t.all_reduces] == ["gather_then_compute"]
    assert modes_training("dion3") == ("dmuon", "gather_then_compute") and modes_training("muon") == MODES
    with pytest.raises(ValueError, match=r"--dmuon-mode megatron_layerwise runs Megatron's own Muon; --dmuon-update "
                                         r"dion3 needs --dmuon-mode dmuon \(or gather_then_compute\)"):
        DMuonConfig(mode="megatron_layerwise", muon=dataclasses.replace(DMuonConfig().muon, update="dion3",
                                                                         fraction=0.25))
