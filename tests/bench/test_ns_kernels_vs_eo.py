"""bench/ns_kernels_vs_eo.py (a GPU benchmark) on CPU at a tiny shape: every requested row is in the JSON,
each either measured with finite numbers or skipped with its reason; bad inputs are one usage line."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import ns_kernels_vs_eo as bench  # noqa: E402

sys.path.pop(0)
HAS_EO = importlib.util.find_spec("emerging_optimizers") is not None


def test_every_row_of_a_tiny_shape_on_cpu(tmp_path):
    assert bench.main(["--device", "cpu", "--shapes", "64x128", "--reps", "1", "--warmup", "0", "--batch", "2",
                       "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "ns_kernels_vs_eo.json").read_text())
    rows = {r["path"]: r for r in report["rows"]}
    assert [r["shape"] for r in report["rows"]] == ["64x128"] * len(bench.PATHS) and set(rows) == set(bench.PATHS)
    assert report["coefficients"] == [list(c) for c in bench.eo_schedule("quintic", 5)] and report["steps"] == 5
    measured = ["dmuon_gram", "dmuon_standard", "dmuon_batched"] + (["eo", "eo_batched"] if HAS_EO else [])
    for path in measured:
        row = rows[path]
        assert row["status"] == "ok", row
        for key in ("ms", "ms_per_matrix", "first_call_s", "tflops_standard", "tflops_own", "rel_diff_to_eo"):
            assert row[key] is not None and math.isfinite(row[key]) and row[key] >= 0, (path, key, row)
        assert row["flops_standard"] == bench.newton_schulz_flops(64, 128, 5, "standard")
    assert rows["dmuon_batched"]["batch"] == 2 and rows["dmuon_gram"]["batch"] == 1
    # the same coefficients: DMuon's outputs sit within bf16 rounding of EO's
    if HAS_EO:
        assert rows["eo"]["rel_diff_to_eo"] == 0.0
        assert all(rows[p]["rel_diff_to_eo"] < 0.05 for p in ("dmuon_gram", "dmuon_standard", "dmuon_batched"))
    skipped = {p: r["reason"] for p, r in rows.items() if r["status"] == "skipped"}
    assert "eo_syrk" in skipped and ("CUDA" in skipped["eo_syrk"] or ">= 0.4.0" in skipped["eo_syrk"]
                                     or "not importable" in skipped["eo_syrk"])
    table = (tmp_path / "ns_kernels_vs_eo.md").read_text()
    assert all(f"| 64x128 | 64x128 | {p}" in table for p in bench.PATHS)


def test_stop_after_s_leaves_later_shapes_as_rows_that_say_so(tmp_path):
    assert bench.main(["--device", "cpu", "--shapes", "32x64,16x16", "--reps", "1", "--warmup", "0", "--batch", "2",
                       "--stop-after-s", "0", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "ns_kernels_vs_eo.json").read_text())["rows"]
    assert {r["status"] for r in rows if r["shape"] == "32x64"} == {"ok", "skipped"}
    later = [r for r in rows if r["shape"] == "16x16"]
    assert len(later) == len(bench.PATHS) and all("--stop-after-s 0 had passed" in r["reason"] for r in later)


def test_square_shapes_skip_the_gram_row_and_names_resolve():
    import argparse

    parser = bench.OneLineParser()
    assert bench.parse_shape_list(parser, "--shapes", "7b.qo,12288x10240") == {"7b.qo": (3584, 3584),
                                                                               "12288x10240": (12288, 10240)}
    assert len(bench.parse_shape_list(parser, "--shapes", "all")) == len(bench.SHAPES) == 13
    assert bench.parse_shape_list(parser, "--syrk-shapes", "none", allow_none=True) == {}
    args = argparse.Namespace()
    why = bench.skip_reason("dmuon_gram", 48, 48, "48x48", args, bench.torch.device("cpu"), None, None, {})
    assert "aspect < 2" in why


@pytest.mark.parametrize("argv,said", [
    (["--shapes", "64x"], "--shapes '64x': give all"),
    (["--shapes", "nope"], "--shapes 'nope'"),
    (["--syrk-shapes", "0x8"], "--syrk-shapes '0x8'"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--coefficient-type", "cubic5", "--steps", "4"], "give --steps 5"),
    (["--coefficient-type", "bogus"], "invalid choice"),
])
def test_bad_inputs_are_one_usage_line(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, err


def test_cuda_without_a_gpu_is_one_usage_line(capsys):
    if bench.torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cuda", "--shapes", "64x128"])
    assert e.value.code == 2 and "no CUDA device here" in capsys.readouterr().err
