"""--dmuon-update / --dmuon-fraction: wired through the one config source; bad combinations fail at
parse time naming the flag and the fix (docs/bad_input.md rows 27-28)."""
import argparse
from types import SimpleNamespace

import pytest

from megatron_dmuon.megatron.flags import add_dmuon_args, validate_dmuon_args
from megatron_dmuon.megatron.optimizer import DMuonChainedOptimizer
from megatron_dmuon.runtime.owner_step import MuonSettings


def _parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="dmuon", choices=["adam"])
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    add_dmuon_args(p, validate=False)
    return validate_dmuon_args(p.parse_args(argv))


def test_update_flags_reach_the_owner_settings():
    assert _parse([]).muon.update == "muon"
    cfg = _parse(["--dmuon-update", "dion3", "--dmuon-fraction-lr", "inverse_sqrt", "--dmuon-normuon-beta2", "0.9"])
    assert (cfg.muon.update, cfg.muon.fraction, cfg.muon.fraction_lr, cfg.muon.row_beta2) == \
        ("dion3", 0.25, "inverse_sqrt", 0.9)
    assert _parse(["--dmuon-update", "dion3", "--dmuon-fraction", "1"]).muon.fraction == 1.0
    assert _parse(["--dmuon-update", "normuon"]).muon.fraction == 1.0


@pytest.mark.parametrize("argv,message", [
    (["--dmuon-update", "dion3", "--dmuon-fraction", "0"], r"--dmuon-fraction 0.0 must be a finite number in \(0, 1\]"),
    (["--dmuon-update", "dion3", "--dmuon-fraction", "1.5"], r"--dmuon-fraction 1.5 must be a finite number in \(0, 1\]"),
    (["--dmuon-fraction", "0.5"], "applies to --dmuon-update dion3 only.*drop --dmuon-fraction"),
    (["--dmuon-update", "normuon", "--dmuon-fraction", "0.5"], "applies to --dmuon-update dion3 only"),
    (["--dmuon-update", "normuon", "--dmuon-momentum-dtype", "bf16"], "drop --dmuon-momentum-dtype bf16"),
    (["--dmuon-update", "dion3", "--muon-nesterov"], "drop --muon-nesterov"),
    (["--dmuon-update", "dion3", "--tensor-model-parallel-size", "2", "--muon-tp-mode", "duplicated"],
     "--tensor-model-parallel-size 1"),
    (["--dmuon-update", "dion3", "--dmuon-mode", "megatron_layerwise"], "needs --dmuon-mode dmuon"),
    (["--dmuon-update", "normuon", "--dmuon-normuon-beta2", "1"], "--dmuon-normuon-beta2 1.0 must be a finite number in"),
], ids=["fraction0", "fraction_over_1", "fraction_with_muon", "fraction_with_normuon", "bf16_momentum", "nesterov", "tp2",
        "layerwise", "beta2"])
def test_bad_update_flags_fail_at_parse_time(argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(argv)


@pytest.mark.parametrize("argv", [["--fraction", "0.5"], ["--update", "dion3", "--fraction", "0"]])
def test_verify_cli_checks_the_fraction(argv, capsys):
    from megatron_dmuon.testing.verify_cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "--fraction" in capsys.readouterr().err
