"""[balance-2]: the rank cost model (planning/rank_cost.py), the start-up rank profile
(runtime/rank_profile.py), the owner MILP on that model (planning/rank_milp.py), `dmuon plan
--rank-model`, and bench/rank_balance.py's CPU smoke run. The model's accuracy on the H200 is
bench/rank_balance.py's job (docs/load_balancing.md); here: that it composes what it measured,
that every plan is scored from its own layout, and that the MILP is never worse than a warm start."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from megatron_dmuon.planning.cost_model import device_spec, elementwise_costs, shape_key
from megatron_dmuon.planning.dp_shards import shard_overlap
from megatron_dmuon.planning.models import PRESETS, ParallelSpec, stage_params
from megatron_dmuon.planning.ns_choice import NSResolver, owner_ns_cost
from megatron_dmuon.planning.planners import buffer_items, plan_stage, predict_rank_ms, split_pieces
from megatron_dmuon.planning.rank_cost import RankCostModel, RankWork, multi_counts, piece_counts
from megatron_dmuon.planning.rank_milp import CANDIDATES, layout_loads, layout_work, plan_rank_owner_layout
from megatron_dmuon.runtime.rank_profile import profile_counts, profile_jobs

from tests import ROOT

SPLIT = dict(split_qkv=True, split_glu=False, per_head=False)
COST_FN = functools.partial(owner_ns_cost, resolver=NSResolver("auto", coefficients="adaptive", steps=5))

# a made-up device whose steps are NOT what the analytic model says: per shape a launch, a per-matrix
# part and a wave step every 4 matrices, in a step of its own; a step of several shapes pays STEP_PART
# once and each stack less its SHAPE_PART (the small 512x3584 stack mostly covered by the others, as
# the H100 measured); AdamW a0 + a1 E + a2 F; 40% of the shorter of Muon and AdamW hidden under the longer
SHARED, STEP_PART, HIDDEN, ADAMW = 0.3, 0.25, 0.4, (0.05, 2.5e-8, 2e-4)
SHAPES = {(3584, 3584): (0.4, 1.6), (512, 3584): (0.9, 0.01), (3584, 37888): (0.2, 7.5), (3584, 18944): (0.2, 3.7)}
SHAPE_PART = {(3584, 3584): 0.45, (512, 3584): 1.0, (3584, 37888): 0.2, (3584, 18944): 0.35}


def true_stack(shape, k):
    launch, per = SHAPES[shape_key(shape)]
    return 0.0 if k <= 0 else SHARED + launch + per * k + 0.3 * per * ((k - 1) // 4)


def true_adamw(elements, fragments):
    return 0.0 if elements <= 0 else ADAMW[0] + ADAMW[1] * elements + ADAMW[2] * fragments


def true_muon(pieces):
    parts = {shape_key(s): true_stack(s, k) for s, k in pieces.items() if k}
    if len(parts) <= 1:
        return sum(parts.values())
    return max(max(parts.values()), STEP_PART + sum(max(0.0, t - SHAPE_PART[s]) for s, t in parts.items()))


def true_rank(work: RankWork):
    muon = true_muon(work.pieces)
    adamw = true_adamw(work.adamw_elements, work.fragments)
    return muon + adamw - HIDDEN * min(muon, adamw)


def calibration(grid=range(1, 41)):
    """What bench/rank_balance.py calibrate (and the start-up profile) measure, on the made-up device."""
    jobs = {}
    for (m, n) in SHAPES:
        for k in grid:
            jobs[f"ns|{m}x{n}|{k}"] = {"ms": true_stack((m, n), k), "adamw_elements": 0, "fragments": 0}
    for e, f in ((10_000_000, 1), (100_000_000, 1), (100_000_000, 100), (400_000_000, 1)):
        jobs[f"adamw|{e // 10**6}M|{f}"] = {"ms": true_adamw(e, f), "adamw_elements": e, "fragments": f}
    jobs["pair|3584x3584|2|512x3584|4"] = {"ms": true_muon({(3584, 3584): 2, (512, 3584): 4})}
    profiled = profile_jobs({(3584, 3584): (3, 6), (512, 3584): (4, 8), (3584, 37888): (1, 2), (3584, 18944): (2, 4)})
    for name in profiled:
        if name.startswith("multi|"):  # every shape together at a rank's share, and each left out
            jobs[name] = {"ms": true_muon(multi_counts(name))}
    muon, adam = true_stack((3584, 18944), 2), true_adamw(100_000_000, 1)
    jobs["mix|3584x18944|2|100M"] = {"ms": muon + adam - HIDDEN * min(muon, adam), "adamw_elements": 100_000_000,
                                     "fragments": 1}
    return {"jobs": jobs, "device": "made-up"}


@pytest.fixture(scope="module")
def model():
    return RankCostModel.from_calibration(calibration(), device_spec("H200"))


def test_the_model_recovers_the_parts_it_measured_and_composes_them(model):
    assert model.shared_ms == pytest.approx(STEP_PART, abs=1e-9)
    assert model.shape_shared == pytest.approx(SHAPE_PART, abs=1e-9)
    assert model.meta["multi_points"] == 7 and model.meta["multi_error"] < 1e-9
    assert model.hidden == pytest.approx(HIDDEN, abs=1e-9)
    assert model.adamw_fit == pytest.approx(ADAMW, rel=1e-6)
    for shape in SHAPES:  # the measured stack curve itself, wave steps included
        for k in (1, 4, 5, 17, 40):
            assert model.stack_ms(shape, k) == pytest.approx(true_stack(shape, k), abs=1e-9)
    # whole ranks it never saw: several shapes at once beside AdamW
    work = RankWork(Counter({(3584, 3584): 7, (512, 3584): 10, (3584, 37888): 2}), 123_456_789, 57)
    assert model.rank_ms(work) == pytest.approx(true_rank(work), abs=1e-9)
    two = RankWork(Counter({(512, 3584): 3, (3584, 18944): 5}))
    assert model.rank_ms(two) == pytest.approx(true_rank(two), abs=1e-9)
    alone = RankWork(Counter(), 5_000_000, 3)
    assert model.rank_ms(alone) == pytest.approx(true_adamw(5_000_000, 3))
    # a JSON round trip predicts the same
    again = RankCostModel.from_json(json.loads(json.dumps(model.to_json())))
    assert again.rank_ms(work) == pytest.approx(model.rank_ms(work), abs=1e-12)
    # between points linear, past the last along the last segment, never decreasing
    sparse = RankCostModel.fit({(64, 128): [(1, 1.0), (4, 2.5)]}, [])
    assert sparse.stack_ms((128, 64), 2) == pytest.approx(1.5) and sparse.stack_ms((64, 128), 8) == pytest.approx(4.5)
    flat = RankCostModel.fit({(64, 128): [(1, 1.0), (4, 0.9)]}, [])
    assert flat.stack_ms((64, 128), 9) == pytest.approx(0.9)
    # an unmeasured shape is predicted at the measured shapes' rate, not refused
    assert model.stack_ms((1024, 4096), 3) > model.stack_ms((1024, 4096), 1) > 0
    with pytest.raises(ValueError, match="hidden"):
        RankCostModel({}, [], hidden=1.5)


def test_piece_counts_and_rank_work():
    assert piece_counts([(3584, 3584), (512, 3584), (512, 3584), (4, 128, 64)]) == Counter(
        {(3584, 3584): 1, (512, 3584): 2, (64, 128): 4})
    w = RankWork()
    w.add_matrix([(18944, 3584)])
    w.add_fragments([10, 20])
    assert w.pieces == Counter({(3584, 18944): 1}) and w.adamw_elements == 30 and w.fragments == 2


def _plan(preset, dp, bucket_size, planner, **kw):
    par = ParallelSpec(dp=dp, ep=4 if PRESETS[preset].num_experts else 1)
    extra = dict(elementwise=elementwise_costs(device_spec("H200"))) if planner in ("greedy", "milp") else {}
    extra.update(kw)
    return plan_stage(PRESETS[preset], par, None, planner, bucket_size=bucket_size, cost_fn=COST_FN, split=SPLIT,
                      **extra), par


def test_each_gpus_work_is_read_off_its_own_layout():
    """layout_work against a count made here from the layout's ranges: the pieces of every matrix
    a rank owns (q, k, v of a QKV) and the AdamW fragments inside its shards."""
    plan, par = _plan("qwen7b-4l", 4, 40_000_000, "greedy")
    layout, params = plan["layouts"]["dense"], plan["params"]["dense"]
    items = buffer_items(params, None, split_pieces(PRESETS["qwen7b-4l"], SPLIT))
    work = layout_work(items, layout)
    for r in range(4):
        pieces = Counter()
        for p in params:
            if p.is_matrix and layout.owners[p.name] == r:
                if "linear_qkv" in p.name:
                    pieces.update({(3584, 3584): 1, (512, 3584): 2})
                else:
                    pieces[shape_key(p.full_shape)] += 1
        sizes = []
        for p in params:
            if not p.is_matrix:
                s, e, b = layout.param_ranges[p.name]
                lo, hi = shard_overlap(s, e, r, layout.buckets[b].shard_size, layout.buckets[b].start)
                sizes += [hi - lo] if hi > lo else []
        assert work[r].pieces == pieces and work[r].adamw_elements == sum(sizes) and work[r].fragments == len(sizes)
    assert sum(w.adamw_elements for w in work) == sum(p.numel for p in params if not p.is_matrix)


LAYOUTS = [("qwen7b-4l", 2, 40_000_000), ("qwen7b-4l", 4, 40_000_000), ("qwen2.5-7b", 8, None),
           ("qwen3-moe-8l", 8, None)]


@pytest.mark.parametrize("preset,dp,bucket_size", LAYOUTS)
def test_the_milp_is_never_predicted_slower_than_any_greedy(model, preset, dp, bucket_size):
    """Pinned: under the rank model the MILP's plan is never slower than its warm starts, the greedy
    (--dmuon-balance cost) and Megatron's LPT rules among them, each scored from its own layout
    (``min_gain`` 0: every predicted gain taken). With the default gate a plan that beats the greedy
    by less than the model's error or MIN_GAIN leaves the greedy, never anything slower than it."""
    from megatron_dmuon.planning.rank_milp import MIN_GAIN

    gated, _ = _plan(preset, dp, bucket_size, "milp", rank_model=model, milp_options={"time_limit_s": 5.0})
    gate = gated["info"]["dense"]
    best = min(gate["candidates"].values())
    if gate["chosen"] == "cost":
        assert gate["makespan"] == pytest.approx(gate["candidates"]["cost"]) and \
            best >= (1 - MIN_GAIN) * gate["candidates"]["cost"] - 1e-9
    else:
        assert gate["makespan"] <= best + 1e-9
    slowest = {}
    for planner in ("greedy", "megatron_lpt", "numel_lpt", "milp"):
        plan, par = _plan(preset, dp, bucket_size, planner, **(
            dict(rank_model=model, milp_options={"time_limit_s": 5.0, "min_gain": 0.0}) if planner == "milp" else {}))
        slowest[planner] = max(predict_rank_ms(plan, par, model, PRESETS[preset], SPLIT))
        if planner == "milp":
            info = plan["info"]["dense"]
            assert set(CANDIDATES) <= set(info["candidates"]) and info["chosen"] in info["candidates"]
            assert info["makespan"] <= min(info["candidates"].values()) + 1e-9
    for planner in ("greedy", "megatron_lpt", "numel_lpt"):
        assert slowest["milp"] <= slowest[planner] + 1e-9, (slowest, planner)
    if (preset, dp) == ("qwen7b-4l", 2):  # and it can win: here the MILP's own plan, by ~0.15 ms of 33
        assert slowest["milp"] < min(slowest[p] for p in ("greedy", "megatron_lpt", "numel_lpt")) - 0.1, slowest


def test_the_milp_falls_back_to_the_best_warm_start_with_a_warning(model, monkeypatch):
    from megatron_dmuon.planning import milp as milp_mod

    def broken(*a, **k):
        raise ImportError("no solver here")

    monkeypatch.setitem(milp_mod.SOLVERS, "cbc", broken)
    monkeypatch.setitem(milp_mod.SOLVERS, "highs", broken)
    with pytest.warns(milp_mod.MilpFallbackWarning, match="no solver here"):
        plan, par = _plan("qwen7b-4l", 2, 40_000_000, "milp", rank_model=model,
                          milp_options={"time_limit_s": 2.0, "polish_share": 0.0, "min_gain": 0.0})
    info = plan["info"]["dense"]
    assert info["status"] == "greedy" and "milp" not in info["candidates"]
    assert info["makespan"] == pytest.approx(min(info["candidates"].values()))


def test_milp_rank_costs_are_the_models_prediction_of_its_layout(model):
    params = stage_params(PRESETS["qwen7b-4l"], ParallelSpec(dp=2))["dense"]
    items = buffer_items(params, None, split_pieces(PRESETS["qwen7b-4l"], SPLIT), COST_FN)
    base = [1.5, 0.0]  # an earlier buffer's load
    cost = list(base)
    layout = plan_rank_owner_layout(items, 2, 40_000_000, rank_cost=cost, milp_options={"time_limit_s": 3.0},
                                    elementwise=elementwise_costs(device_spec("H200")), model=model)
    predicted = layout_loads(items, layout, model, base)
    assert cost == pytest.approx(predicted) and layout.rank_cost == pytest.approx(predicted)


def _fake_owner_step(calls):
    def fake(matrices, fragments):  # the made-up device, timed
        calls.append(len(matrices))
        w = RankWork()
        for _, shape, _ in matrices:
            w.add_matrix([shape])
        w.add_fragments(fragments)
        return true_rank(w)
    return fake


def test_rank_profile_measures_in_order_within_its_budget_and_caches(tmp_path):
    from megatron_dmuon.runtime.rank_profile import profile_jobs, profiled_rank_model

    counts = {(3584, 3584): 6, (512, 3584): 8, (3584, 18944): 2}
    jobs = list(profile_jobs(counts))
    # one matrix of every shape first, then AdamW, each shape at an even share (half the profiled
    # count), the shared parts, the hidden part, then the counts
    assert jobs[:3] == ["ns|512x3584|1", "ns|3584x3584|1", "ns|3584x18944|1"]
    assert jobs[3:6] == ["adamw|10M|1", "adamw|100M|1", "adamw|100M|100"]
    assert jobs[6:8] == ["ns|512x3584|4", "ns|3584x3584|3"]  # (3584x18944's share is its one-matrix point)
    # every shape at a rank's share together, each left out in turn, and all at one matrix
    assert jobs[8:13] == ["multi|512x3584:4|3584x3584:3|3584x18944:1", "multi|3584x3584:3|3584x18944:1",
                          "multi|512x3584:4|3584x18944:1", "multi|512x3584:4|3584x3584:3",
                          "multi|512x3584:1|3584x3584:1|3584x18944:1"]
    assert jobs[13] == "mix|3584x18944|1|100M"
    assert "ns|3584x3584|6" in jobs and "ns|3584x18944|2" in jobs and len(jobs) == len(set(jobs))
    # no profiled step holds more than MAX_ELEMENTS matrix elements (the model is on the GPU already)
    assert "ns|3584x37888|3" in profile_jobs({(37888, 3584): 8}) and "ns|3584x37888|8" not in profile_jobs({(37888, 3584): 8})
    calls = []
    fake = _fake_owner_step(calls)
    cache = str(tmp_path / "profile.json")
    first = profiled_rank_model(counts, time_fn=fake, cache_path=cache)
    assert len(calls) == len(jobs)
    work = RankWork(Counter({(3584, 3584): 5, (512, 3584): 6}), 50_000_000, 10)
    assert first.rank_ms(work) == pytest.approx(true_rank(work), rel=0.05)  # from the start-up points alone
    calls.clear()
    again = profiled_rank_model(counts, time_fn=fake, cache_path=cache)
    assert calls == [] and again.rank_ms(work) == first.rank_ms(work)  # the cache: nothing measured
    ticks = iter(range(1000))
    from megatron_dmuon.runtime import rank_profile

    with pytest.warns(RuntimeWarning, match="budget"):
        partial = rank_profile.measure_rank_jobs(profile_jobs(counts), fake, budget_s=2.5,
                                                 clock=lambda: float(next(ticks)))
    assert list(partial) == jobs[:2]  # the clock ticks once per point: 2 points fit in 2.5 s


@pytest.mark.parametrize("damage", ["garbage", "old_version", "bad_point", "not_a_dict", "other_settings",
                                    "missing_points"])
def test_a_damaged_or_stale_rank_profile_cache_is_measured_again_with_a_warning(tmp_path, damage):
    """The start-up profile never plans on a damaged cache entry: it is measured again (with a warning
    naming the cache; what is still valid of a partial entry is kept), and the next start is silent."""
    import warnings

    from megatron_dmuon.runtime.rank_profile import profiled_rank_model

    counts = {(3584, 3584): 4, (512, 3584): 4}
    path = tmp_path / "profile.json"
    calls = []
    profiled_rank_model(counts, time_fn=_fake_owner_step(calls), cache_path=str(path))
    points = len(calls)
    data = json.loads(path.read_text())
    key = next(iter(data["entries"]))
    entry = data["entries"][key]
    first = next(iter(entry["jobs"]))
    if damage == "garbage":  # a file of ours cut short (one that is not ours is refused: tests/planning/test_caches.py)
        path.write_text(path.read_text()[:50])
    else:
        if damage == "old_version":
            data["version"] = 0
        elif damage == "bad_point":
            entry["jobs"][first] = {"ms": "fast", "adamw_elements": 0, "fragments": 0}
        elif damage == "not_a_dict":
            entry["jobs"][first] = [1.0]
        elif damage == "other_settings":
            entry["meta"]["steps"] = 6
        else:
            del entry["jobs"][first]
        path.write_text(json.dumps(data))
    calls = []
    if damage == "missing_points":  # a profile cut short by its budget: the rest is measured, silently
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            profiled_rank_model(counts, time_fn=_fake_owner_step(calls), cache_path=str(path))
        assert len(calls) == 1
    else:
        with pytest.warns(RuntimeWarning):
            profiled_rank_model(counts, time_fn=_fake_owner_step(calls), cache_path=str(path))
        assert len(calls) == points
    calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = profiled_rank_model(counts, time_fn=_fake_owner_step(calls), cache_path=str(path))
    assert calls == []  # whole again: the next start measures nothing
    work = RankWork(Counter({(3584, 3584): 3, (512, 3584): 4}), 0, 0)
    assert again.rank_ms(work) == pytest.approx(true_rank(work), rel=0.05)

def test_dmuon_plan_prints_the_four_planners_on_the_whole_owner_step(tmp_path, model, capsys):
    # the first two in this process (plan_cli.main), the refusal through `python -m` (its entry point, exit 2)
    from megatron_dmuon.planning.plan_cli import main as dmuon_plan

    path = tmp_path / "rank_model.json"
    path.write_text(json.dumps(model.to_json()))
    code = dmuon_plan(["--preset", "qwen7b-4l", "--dp", "2", "--overlap-grad-reduce", "--rank-model", str(path),
                       "--dmuon-coefficients", "adaptive", "--planners", "greedy", "--time-limit", "3", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)["owner_step"]
    assert list(report["plans"]) == ["greedy", "numel_lpt", "megatron_lpt", "milp"]
    milp, best = report["plans"]["milp"]["makespan_ms"], min(r["makespan_ms"] for r in report["plans"].values())
    # (the best, or the greedy kept where the best beats it by less than MIN_GAIN)
    assert milp <= best + 1e-9 or milp == pytest.approx(report["plans"]["greedy"]["makespan_ms"]) and best >= 0.98 * milp
    code = dmuon_plan(["--preset", "qwen7b-4l", "--dp", "2", "--rank-model", "analytic", "--planners", "greedy",
                       "--time-limit", "2"])
    text = capsys.readouterr()
    assert code == 0 and "| GPU | greedy | numel_lpt | megatron_lpt | milp |" in text.out, text.err
    bad = subprocess.run([sys.executable, "-m", "megatron_dmuon.planning.plan_cli", "--preset", "tiny", "--dp", "2",
                          "--rank-model", str(tmp_path / "missing.json")], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--rank-model" in bad.stderr


def test_rank_balance_bench_runs_on_cpu(tmp_path):
    """The H200 script's CPU smoke run: calibrate and emulate write their JSON, and the calibration
    fits a rank model (no timing claims off the GPU). Calibrate and emulate through the script's main in
    this process; check through the script itself (python bench/rank_balance.py, as the H200 runs it)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import rank_balance as rb

    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for mode, extra in (("calibrate", ["--adamw-sizes", "1", "2"]),
                        ("emulate", ["--plans", "greedy", "megatron_lpt", "milp", "--rank-profile",
                                     str(tmp_path / "calibrate.json"), "--milp-time-limit", "2"])):
        rb.main([mode, "--layouts", "tiny/dp2/one", "tiny-moe/dp4/ep2/one", "--rounds", "1", "--iters", "1",
                 "--warmup", "1", "--device", "cpu", "--out", str(tmp_path / mode), *extra])  # (a usage error: SystemExit)
        assert (tmp_path / f"{mode}.json").is_file() and (tmp_path / f"{mode}.md").is_file(), mode
    cal = json.loads((tmp_path / "calibrate.json").read_text())
    fitted = RankCostModel.from_calibration(cal, device_spec("H200"))
    assert fitted.stacks and len(fitted.adamw_points) == 4 and fitted.meta["multi_points"] >= 1  # (CPU: no rates)
    emu = json.loads((tmp_path / "emulate.json").read_text())
    lay = emu["layouts"]["tiny/dp2/one"]["plans"]["greedy"]
    assert len(lay["ranks"]) == 2 and lay["slowest_ms"] == max(r["ms"] for r in lay["ranks"])
    milp = emu["layouts"]["tiny/dp2/one"]["plans"]["milp"]
    assert milp["info"]["dense"]["chosen"] in milp["info"]["dense"]["candidates"]
    # check: each emulated GPU and plan predicted, the model fitted again on the other layout's GPUs
    out = subprocess.run([sys.executable, "bench/rank_balance.py", "check", "--emulation", str(tmp_path / "emulate.json"),
                          "--models", f"cal={tmp_path / 'calibrate.json'}", "--refit-points",
                          str(tmp_path / "calibrate.json"), "--refit-on", str(tmp_path / "emulate.json"), "--device",
                          "cpu", "--out", str(tmp_path / "check")], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    check = json.loads((tmp_path / "check.json").read_text())
    plans = {(r["layout"], r["plan"]) for r in check["check_plans"]}
    assert plans == {(spec, p) for spec in ("tiny/dp2/one", "tiny-moe/dp4/ep2/one") for p in ("greedy", "megatron_lpt", "milp")}
    assert all(r["model"] == "cal" and r["predicted_ms"] > 0 for r in check["check_ranks"] if r["emulated_ms"] > 0)


@pytest.mark.parametrize("spec", ["qwen7b-4l/dp4/buckets", "qwen2.5-7b/dp8/one", "tiny-moe/dp4/ep2/one"])
def test_megatron_layerwise_gpus_own_every_matrix_once_and_shard_adamw_evenly(spec):
    """bench/rank_balance.py's emulation of Megatron-LM's LayerWise Muon per GPU: every matrix on
    exactly one GPU of each (expert) DP group, at the owners of Megatron's LPT rule; the element-wise
    params of each buffer split over its DP group in equal shards (Megatron's DistributedOptimizer),
    every element stepped exactly once per group."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import rank_balance as rb

    cfg = rb.job_settings([])
    model, par, size = rb.parse_layout(spec)
    lpt = rb.gpu_work(rb.make_plans(model, par, size, cfg, ["megatron_lpt"])["megatron_lpt"], model, par,
                      cfg.split_flags())
    work = rb.megatron_layerwise_work(model, par, [m for m, _ in lpt])
    gpus = par.dp_size * par.tp
    assert len(work) == gpus
    assert [sorted(n for n, _, _ in m) for m, _ in work] == [sorted(n for n, _, _ in m) for m, _ in lpt]
    params = stage_params(model, par)
    # experts: each expert-DP group (GPUs with the same EP rank) holds each local expert matrix once
    groups = par.ep if model.num_experts else 1
    owned = Counter(n for m, _ in work for n, _, _ in m)
    matrices = [p.name for kind in params for p in params[kind] if p.is_matrix]
    dense = {p.name for p in params["dense"] if p.is_matrix}
    assert set(owned) == set(matrices)
    assert all(owned[n] == (1 if n in dense else groups) for n in matrices)
    elementwise = {k: sum(p.numel for p in ps if not p.is_matrix) for k, ps in params.items()}
    per_gpu = [sum(f) for _, f in work]
    assert sum(per_gpu) == elementwise["dense"] + elementwise["expert"] * groups
    assert max(per_gpu) - min(per_gpu) <= 2 * max(1, par.dp_size)  # equal shards (ceil)


def test_tp_cells_hold_their_shards_of_the_rows_matrices_and_model_the_exchange():
    """A TP2 x DP4 layout: each GPU's owned matrices (full, NS on them) and its shards of the matrices
    its DP row owns but the other TP rank orthogonalizes; the row's matrices are covered exactly once
    (owned whole on one TP rank, a shard on the other), and the modelled exchange grows with the
    bytes a GPU sends or receives."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import rank_balance as rb

    cfg = rb.job_settings([])
    model, par, size = rb.parse_layout("qwen2.5-7b/tp2/dp4/buckets")
    assert (par.tp, par.dp_size) == (2, 4)
    plan = rb.make_plans(model, par, size, cfg, ["greedy"])["greedy"]
    work = rb.gpu_work(plan, model, par, cfg.split_flags())
    cells = rb.tp_cell_work(plan, par)
    layout, params = plan["layouts"]["dense"], {p.name: p for p in plan["params"]["dense"]}
    for row in range(par.dp_size):
        gpus = [row * 2, row * 2 + 1]  # TP fastest in Megatron's rank order
        row_mats = sorted(n for n, p in params.items() if p.is_matrix and layout.owners[n] == row)
        owned = sorted(n for g in gpus for n, _, _ in work[g][0])
        assert owned == row_mats
        for g, other in (gpus, gpus[::-1]):
            expect = sorted(params[n].numel for n, _, _ in work[other][0])
            assert sorted(cells[g][0]) == expect
            assert cells[g][1] > 0
    # the exchange model: more bytes, more time
    heavy = max(range(8), key=lambda g: sum(cells[g][0]) + sum(params[n].numel for n, _, _ in work[g][0]))
    light = min(range(8), key=lambda g: sum(cells[g][0]) + sum(params[n].numel for n, _, _ in work[g][0]))
    assert cells[heavy][1] >= cells[light][1]


def test_scale_table_adds_the_modelled_collectives_to_the_emulated_compute(tmp_path):
    """bench/rank_balance.py scale on an emulation JSON: DMuon, Megatron's LayerWise Muon and AdamW per
    layout, each step = its slowest GPU's emulated compute + the modelled param all-gather of its
    buffers (more GPUs over more nodes: a slower collective per byte)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import rank_balance as rb

    layouts = {}
    for spec, ms in (("qwen2.5-7b/dp8/one", 20.0), ("qwen2.5-7b/dp256/buckets", 5.0)):
        plans = {name: {"slowest_ms": ms * f} for name, f in (("greedy", 1.0), ("milp", 0.9),
                                                                (rb.MEGATRON, 1.5), (rb.ADAMW, 0.5))}
        plans["split"] = {"slowest_ms": ms, "slowest_with_exchange_ms": 1.2 * ms}  # the exchange to its NS homes
        layouts[spec] = {"plans": plans}
    path = tmp_path / "emu.json"
    path.write_text(json.dumps({"layouts": layouts}))
    args = rb.argparse.Namespace(emulation=[str(path)], cluster="h200", flags="", global_batch=1024)
    rows = rb.scale(args, print)["scale_rows"]
    assert [r["gpus"] for r in rows] == [8, 256]
    for r, ms in zip(rows, (20.0, 5.0)):
        assert r["dmuon_milp_ms"] == 0.9 * ms and r["dmuon_ms"] == ms and r["dmuon_split_ms"] == 1.2 * ms
        assert r["megatron_ms"] == 1.5 * ms and r["adamw_ms"] == 0.5 * ms
        assert r["dmuon_publish_ms"] > 0 and r["megatron_publish_ms"] > 0 and r["adamw_publish_ms"] > 0
        assert r["adamw_reduce_ms"] == pytest.approx(2 * r["adamw_publish_ms"], rel=0.05)  # fp32 vs bf16
        # the iteration: forward + backward of 1024 sequences over the GPUs, then the step
        assert r["adamw_iteration_ms"] >= r["forward_backward_ms"] + r["adamw_ms"] + r["adamw_publish_ms"]
        # the split layout's buffers are Megatron's own: AdamW's all-gather, not the padded one
        assert r["dmuon_split_publish_ms"] == pytest.approx(r["adamw_publish_ms"], rel=0.01)
    assert rows[1]["adamw_publish_ms"] > rows[0]["adamw_publish_ms"]  # more nodes: the inter-node link
    assert rows[1]["dmuon_publish_ms"] > 3 * rows[1]["dmuon_split_publish_ms"]  # whole matrices padded at DP 256
    assert [r["picked"] for r in rows] == ["whole", "split"]  # what --dmuon-dp-layout auto picks there
    text = rb.table({"scale_rows": rows, "cluster": "h200", "global_batch": 1024})
    assert "| qwen2.5-7b/dp256/buckets | 256 | split |" in text


def test_the_milp_keeps_the_greedy_plan_when_the_profile_missed_a_shape_or_adamw(model):
    """A start-up profile cut by its budget (measured on the H100: two shapes, no AdamW; the rest
    predicted at the small shapes' rate came out 2.7x the emulated step): the MILP does not plan on
    it, it keeps the greedy plan (--dmuon-balance cost) and says why; a complete model plans."""
    from megatron_dmuon.planning.milp import MilpFallbackWarning

    cut = RankCostModel({(512, 3584): [(1, 2.6)], (3584, 3584): [(1, 2.8)]}, [], meta={"source": "measured"})
    assert cut.unmeasured([(512, 3584), (3584, 18944)], adamw=True) == ["3584x18944", "AdamW"]
    assert RankCostModel.analytic(device_spec("H200")).unmeasured([(3584, 18944)], adamw=True) == []
    with pytest.warns(MilpFallbackWarning, match="`layout.plan_budget_s`.*greedy") as said:
        plan, _ = _plan("qwen7b-4l", 4, 40_000_000, "milp", rank_model=cut, milp_options={"time_limit_s": 2.0})
    # the DDP (megatron/ddp.py) says it again in the flags' words
    from megatron_dmuon.megatron.config import in_flag_words

    worded = in_flag_words(str(said[0].message))
    assert "ran out of --dmuon-plan-budget" in worded and "kept the greedy plan (--dmuon-balance cost)" in worded
    info = plan["info"]["dense"]
    assert info["chosen"] == "cost" and info["status"] == "unmeasured"
    greedy, _ = _plan("qwen7b-4l", 4, 40_000_000, "greedy")
    assert plan["layouts"]["dense"].owners == greedy["layouts"]["dense"].owners
    plan, _ = _plan("qwen7b-4l", 4, 40_000_000, "milp", rank_model=model, milp_options={"time_limit_s": 2.0})
    assert plan["info"]["dense"]["status"] != "unmeasured"


# [scale-emulation] recorded on one H100 (/tmp/rb_rerun, docs/load_balancing.md): Qwen 4-layer at DP 4, Megatron's
# buckets. The start-up model as it planned (format 1: one shared part, from one pair step):
H100_DP4_FORMAT1 = {
    "format": 1, "shared_ms": 4.130, "hidden": 0.3087, "device": None, "meta": {"source": "calibration"},
    "stacks": {"512x3584": [[1, 2.626], [2, 3.427], [4, 3.663]], "3584x3584": [[1, 3.521], [2, 5.775], [4, 8.548]],
               "3584x18944": [[1, 6.282], [2, 9.463]], "3584x37888": [[1, 9.007], [2, 15.495]]},
    "adamw": [[100_000_000, 1, 1.2325], [100_000_000, 100, 1.7710], [10_000_000, 1, 0.2704]]}
# every ns point the day's start-up profiles measured of those shapes (ms)
H100_STACKS = {(512, 3584): [(1, 2.63), (2, 3.43), (4, 3.66), (7, 4.13), (8, 4.65), (14, 3.2), (28, 4.92)],
               (3584, 3584): [(1, 3.52), (2, 5.77), (4, 8.55), (7, 13.33), (8, 15.34), (14, 24.59), (28, 49.63)],
               (3584, 18944): [(1, 6.28), (2, 9.46), (3, 13.13), (4, 17.19), (7, 31.75)],
               (3584, 37888): [(1, 9.01), (2, 15.49), (3, 22.47)]}
Q, O, F2, F1 = (512, 3584), (3584, 3584), (3584, 18944), (3584, 37888)
# emulated GPUs, (pieces, AdamW elements, fragments, median ms): the DP 2 layout's, the same day
H100_DP2_RANKS = [({Q: 2, O: 3, F2: 1, F1: 3}, 63_680_568, 9, 34.38), ({Q: 6, O: 5, F2: 3, F1: 1}, 165_727_688, 4, 34.14),
                  ({Q: 6, O: 5, F2: 1, F1: 2}, 170_100_280, 6, 33.60), ({Q: 2, O: 3, F2: 3, F1: 2}, 59_307_976, 7, 35.03)]
# and the DP 4 layout's slowest GPU under the greedy and under the MILP planned on the format-1 model
H100_DP4_GREEDY = [({F1: 2}, 28_672_000, 1, 15.49), ({Q: 2, O: 2, F2: 3}, 67_207_168, 6, 18.35),
                   ({Q: 6, O: 6, F2: 1}, 104_857_088, 7, 18.89)]
H100_DP4_MILP = [({Q: 2, O: 1, F1: 1}, 143_374_336, 6, 13.30), ({Q: 2, O: 3, F2: 1, F1: 1}, 28_672_000, 1, 20.89),
                 ({F2: 2, F1: 1}, 28_672_000, 1, 18.16), ({Q: 4, O: 4, F2: 1, F1: 1}, 28_689_920, 6, 22.81)]


def _slowest(model, ranks, format_1=False):
    """(predicted, emulated) slowest GPU; ``format_1``: as format-1 code predicted (the stacks less the
    shared part once per shape but one, unbounded)."""
    def predict(pieces, elements, fragments):
        if not format_1:
            return model.rank_ms(RankWork(Counter(pieces), elements, fragments))
        muon = sum(model.stack_ms(s, k) for s, k in pieces.items()) - model.shared_ms * (len(pieces) - 1)
        adamw = model.adamw_ms(elements, fragments)
        return muon + adamw - model.hidden * min(muon, adamw)
    return max(predict(p, e, f) for p, e, f, _ in ranks), max(ms for *_, ms in ranks)


def test_on_the_h100s_numbers_one_pair_misses_and_steps_of_every_shape_fit():
    """The format-1 model (shared 4.13 ms, from one pair step: more than the whole one-matrix 512x3584
    stack, and taken 3 times off a 4-shape GPU) predicted the MILP's plan 2.4% faster than the greedy's
    and both ~16-30% low; the MILP's plan emulated 21% slower. Fitted on steps of all four shapes at a
    rank's counts (here the DP 2 layout's GPUs stand in for the profile's multi steps: out of sample for
    DP 4), the slowest GPUs within 5% (MILP) and 7% (greedy) and the plans in the emulated order."""
    old = RankCostModel.from_json(H100_DP4_FORMAT1)
    assert old.shape_shared == {} and old.shared_of(Q) == old.shared_ms == pytest.approx(4.13)
    (greedy, greedy_ms), (milp, milp_ms) = (_slowest(old, H100_DP4_GREEDY, format_1=True),
                                            _slowest(old, H100_DP4_MILP, format_1=True))
    assert milp < greedy and milp_ms > 1.2 * greedy_ms  # the model's order, and the emulated one
    assert milp / milp_ms - 1 < -0.3 and greedy / greedy_ms - 1 < -0.15
    # loaded today (a shape's part never more than its stack, a step never below its largest stack)
    (greedy, _), (milp, _) = _slowest(old, H100_DP4_GREEDY), _slowest(old, H100_DP4_MILP)
    assert milp / milp_ms - 1 < -0.25 and greedy / greedy_ms - 1 < -0.12
    base = RankCostModel.fit(H100_STACKS, old.adamw_points)
    muon_only = [(p, ms - base.adamw_ms(e, f) * (1 - old.hidden)) for p, e, f, ms in H100_DP2_RANKS]
    new = RankCostModel.fit(H100_STACKS, old.adamw_points, multi=muon_only)
    new.hidden = old.hidden
    # every step held all four shapes: only their sum with the step's part is told, one constant
    assert len(set(new.shape_shared.values())) == 1 and new.shared_ms == pytest.approx(1.46, abs=0.02)
    assert new.meta["multi_error"] < 0.04
    (greedy, greedy_ms), (milp, milp_ms) = _slowest(new, H100_DP4_GREEDY), _slowest(new, H100_DP4_MILP)
    assert abs(greedy / greedy_ms - 1) < 0.07 and abs(milp / milp_ms - 1) < 0.05
    assert milp > 1.1 * greedy  # the MILP would not pick that plan on this model


def test_format_1_models_load_as_one_shared_part_and_unknown_formats_are_refused():
    old = RankCostModel.from_json(H100_DP4_FORMAT1)
    three = {O: 4, F2: 1, F1: 1}  # format 1: the sum of the stacks less 2 shared parts (each stack > 4.13 ms)
    assert old.muon_ms(three) == pytest.approx(sum(old.stack_ms(s, k) for s, k in three.items()) - 2 * 4.130)
    four = {Q: 4, O: 4, F2: 1, F1: 1}  # 512x3584's 3.66 ms stack: covered whole, not 4.13 ms taken off it
    again = RankCostModel.from_json(json.loads(json.dumps(old.to_json())))
    assert old.muon_ms(four) == pytest.approx(old.muon_ms(three))
    assert again.to_json()["format"] == 2 and again.muon_ms(four) == pytest.approx(old.muon_ms(four))
    with pytest.raises(ValueError, match="format 3"):
        RankCostModel.from_json(dict(H100_DP4_FORMAT1, format=3))


def test_the_shared_parts_fit():
    """One pair: the format-1 constant for both shapes and the step; a step of several shapes slower
    than its stacks apart (the H100's 32B GPU: +3 ms on 44): negative parts, within their bounds; a
    step of several shapes never predicted below its largest stack."""
    stacks = {(64, 128): [(1, 1.0), (4, 2.5)], (128, 256): [(1, 3.0), (2, 5.0)], (32, 64): [(1, 0.5)]}
    model = RankCostModel.fit(stacks, [], multi=[({(64, 128): 1, (128, 256): 2}, 5.4)])
    assert model.shared_ms == pytest.approx(0.6) and model.shape_shared == pytest.approx({(64, 128): 0.6, (128, 256): 0.6})
    assert model.shared_of((32, 64)) == pytest.approx(0.6)  # a shape no step held: the step's part
    slower = RankCostModel.fit(stacks, [], multi=[({(64, 128): 1, (128, 256): 2}, 6.5)])
    assert slower.shared_ms == pytest.approx(-0.5) and slower.muon_ms({(64, 128): 1, (128, 256): 2}) == pytest.approx(6.5)
    way_off = RankCostModel.fit(stacks, [], multi=[({(64, 128): 1, (128, 256): 2}, 60.0)])
    assert way_off.shared_ms == pytest.approx(-1.0)  # -(the cheapest one-matrix stack)
    covered = RankCostModel.fit(stacks, [], multi=[({(64, 128): 1, (128, 256): 2}, 0.1)])
    assert covered.muon_ms({(64, 128): 1, (128, 256): 2}) == pytest.approx(5.0)  # its largest stack
    assert covered.muon_ms({(64, 128): 4, (128, 256): 2}) >= covered.muon_ms({(64, 128): 1, (128, 256): 2})
    both_whole = RankCostModel(stacks, [], shared_ms=0.0, shape_shared={(64, 128): 1.0, (128, 256): 5.0})
    assert both_whole.muon_ms({(64, 128): 1, (128, 256): 2}) == pytest.approx(5.0)


def test_the_model_error_is_also_measured_on_each_step_left_out():
    """Steps that just determine the parts (the H100's Qwen2.5-7B DP 64 profile: five steps, five
    parts) fit with no in-sample error; each step left out of the fit and predicted shows the real
    one, which the MILP's gate reads."""
    stacks = {(64, 128): [(1, 1.0), (4, 2.5)], (128, 256): [(1, 3.0), (2, 5.0)], (32, 64): [(1, 0.5), (3, 1.0)]}
    a, b, c = (64, 128), (128, 256), (32, 64)
    true = RankCostModel(stacks, [], shared_ms=0.3, shape_shared={a: 0.5, b: 0.2, c: 0.1})
    counts = [{a: 1, b: 2}, {a: 1, c: 3}, {b: 2, c: 3}, {a: 1, b: 2, c: 3}, {a: 4, b: 1}, {a: 2, c: 1}, {b: 1, c: 2}]
    steps = [(k, true.muon_ms(k)) for k in counts]
    model = RankCostModel.fit(stacks, [], multi=steps[:4])
    assert model.meta["multi_points"] == 4 and model.meta["multi_error"] < 1e-9  # 4 steps, 4 parts: exact
    assert model.meta["multi_holdout_error"] > 0.1  # but the other three do not predict a step
    refit = RankCostModel.fit(stacks, [], multi=steps[:3])
    assert model.meta["multi_holdout_error"] >= abs(refit.muon_ms(counts[3]) / steps[3][1] - 1) - 1e-12
    # more steps of the same device: the parts are pinned down and a step left out is predicted closely
    assert RankCostModel.fit(stacks, [], multi=steps).meta["multi_holdout_error"] < 0.02


def test_the_profile_measures_the_counts_a_cost_balanced_plan_gives_one_rank():
    """Qwen2.5-7B at DP 64: an even share is one matrix of each shape, but the H100's greedy gave one
    rank 8 of the 56 512x3584 pieces (the curve measured at 1 and 2 and extrapolated was 1.8x off):
    a shape is profiled up to the count whose NS work equals one matrix of the costliest shape."""
    counts = profile_counts({Q: 56, O: 56, F2: 28, F1: 28}, 64)
    assert counts == {Q: (1, 56), O: (1, 11), F2: (1, 2), F1: (1, 2)}
    jobs = profile_jobs(counts)
    assert {"ns|512x3584|56", "ns|512x3584|28", "ns|3584x3584|11", "ns|3584x3584|5"} <= set(jobs)
    assert "multi|512x3584:1|3584x3584:1|3584x18944:1|3584x37888:1" in jobs
    # one GPU for the whole model: the step of every shape is scaled down to MAX_ELEMENTS
    from megatron_dmuon.runtime.rank_profile import MAX_ELEMENTS

    whole = [multi_counts(n) for n in profile_jobs(profile_counts({Q: 56, O: 56, F2: 28, F1: 28}, 1))
             if n.startswith("multi|") and len(multi_counts(n)) == 4 and set(multi_counts(n).values()) != {1}]
    assert len(whole) == 1 and sum(k * m * n for (m, n), k in whole[0].items()) <= MAX_ELEMENTS


def test_the_milp_keeps_the_greedy_plan_when_its_gain_is_within_the_models_error(model):
    """A plan predicted faster than the greedy by less than the model's own error on its steps of
    several shapes, or than MIN_GAIN (the H100's round-to-round noise), is not taken (on the H100 a
    plan predicted 2.3% faster emulated 21% slower, and one predicted 0.2% faster 1.7% slower)."""
    from megatron_dmuon.planning.rank_milp import MIN_GAIN

    free, _ = _plan("qwen7b-4l", 2, 40_000_000, "milp", rank_model=model,
                    milp_options={"time_limit_s": 3.0, "min_gain": 0.0})
    info = free["info"]["dense"]
    gain = 1 - info["makespan"] / info["candidates"]["cost"]
    assert 0.003 < gain < MIN_GAIN  # this device: the MILP's plan wins, by less than the noise
    greedy, _ = _plan("qwen7b-4l", 2, 40_000_000, "greedy")
    exact = RankCostModel.from_json(model.to_json())
    exact.meta.update(multi_error=0.0, multi_holdout_error=0.0)  # an exact fit: only the floor holds
    unsure = RankCostModel.from_json(model.to_json())
    unsure.meta.update(multi_error=0.0, multi_holdout_error=2 * gain)
    for judged in (exact, unsure):
        kept, _ = _plan("qwen7b-4l", 2, 40_000_000, "milp", rank_model=judged, milp_options={"time_limit_s": 3.0})
        info = kept["info"]["dense"]
        assert info["chosen"] == "cost" and "kept the greedy plan" in info["note"]
        assert info["makespan"] == pytest.approx(info["candidates"]["cost"])
        assert kept["layouts"]["dense"].owners == greedy["layouts"]["dense"].owners
    forced, _ = _plan("qwen7b-4l", 2, 40_000_000, "milp", rank_model=unsure,
                      milp_options={"time_limit_s": 3.0, "min_gain": 0.0})
    assert forced["info"]["dense"]["makespan"] == pytest.approx(info["makespan"] * (1 - gain), rel=1e-6)


def test_the_scale_tables_overlapped_step_pipelines_each_groups_ns_with_the_all_gathers(tmp_path):
    """bench/rank_scale.py's step under --dmuon-overlap-step on, from one emulated time per GPU: never
    shorter than Megatron's per-bucket all-gathers (nor than the split layout's exchange beside them),
    the whole compute hidden when the NS is short, exposed when it is long, and 0 NS leaves the
    collectives alone."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import rank_balance as rb
    from rank_layouts import gpu_work, job_settings, make_plans, parse_layout, split_cell_work
    from rank_scale import bucket_all_gathers_ms, overlapped_step_ms
    from megatron_dmuon.planning.cost_model import cluster_spec

    spec = "qwen2.5-7b/dp16/buckets"
    model, par, size = parse_layout(spec)
    cfg = job_settings([])
    plans = make_plans(model, par, size, cfg, ["greedy", "split"])
    cluster = cluster_spec("h200")

    def ranks(name, ms):
        work = gpu_work(plans[name], model, par, cfg.split_flags())
        pieces = split_cell_work(plans[name], par) if name == "split" else [([], 0.0)] * par.dp_size
        return [{"gpu": g, "ms": ms, "muon_elements": sum(s[0] * s[1] for _, s, _ in mats), "adamw_elements": sum(frags),
                 "tp_shard_elements": sum(pieces[g][0])} for g, (mats, frags) in enumerate(work)]

    for name in ("greedy", "split"):
        ag = sum(bucket_all_gathers_ms(plans[name], cluster))
        alone = overlapped_step_ms(plans[name], par, cluster, ranks(name, 0.0))
        assert alone >= ag - 1e-9 and (alone > ag) == (name == "split")  # the split layout's exchange
        short, long = (overlapped_step_ms(plans[name], par, cluster, ranks(name, ms)) for ms in (1.0, 200.0))
        assert alone < short < alone + 1.0 + 1e-9  # 1 ms a GPU: the element-wise part and the first group's NS
        assert long > alone + 100  # 200 ms a GPU cannot hide behind the all-gathers
    # through the scale table: the columns of both layouts, and AdamW's per-bucket publish
    layouts = {spec: {"plans": {"greedy": {"slowest_ms": 30.0, "ranks": ranks("greedy", 30.0)},
                                "split": {"slowest_ms": 30.0, "slowest_with_exchange_ms": 36.0},
                                rb.ADAMW: {"slowest_ms": 5.0}}}}
    path = tmp_path / "emu.json"
    path.write_text(json.dumps({"layouts": layouts}))
    row = rb.scale(rb.argparse.Namespace(emulation=[str(path)], cluster="h200", flags="", global_batch=1024),
                   print)["scale_rows"][0]
    assert row["dmuon_on_ms"] < row["dmuon_ms"] + row["dmuon_publish_ms"]  # 30 ms of NS beside the all-gathers
    assert "dmuon_split_on_ms" not in row  # (no GPU of its own in that file: not modelled)
    assert row["adamw_on_ms"] == pytest.approx(5.0 + sum(bucket_all_gathers_ms(plans["split"], cluster)))
