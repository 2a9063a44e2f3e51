"""The planner's overlap model (planning/compute_model.py, planning/simulate_overlap.py): the compute
calibration, and the exposed owner NS of --dmuon-overlap-step off / on / on with the backward start."""
import json
import os

import pytest

from megatron_dmuon.planning.compute_model import CALIBRATION, forward_segments, iteration_flops, model_tflops
from megatron_dmuon.planning.cost_model import CostModel, cluster_spec, device_spec, load_bench_kernels_profile
from megatron_dmuon.planning.models import PRESETS, ParallelSpec
from megatron_dmuon.planning.owner_layout import megatron_bucket_size
from megatron_dmuon.planning.planners import plan_stage
from megatron_dmuon.planning.simulate_overlap import group_ns_ms, need_groups, simulate_overlap
from tests import DATA

BENCH = os.path.join(DATA, "bench_kernels_h200_profile.json")
ETAS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


@pytest.fixture(scope="module")
def h200():
    return CostModel(device_spec("H200"), load_bench_kernels_profile(BENCH)), cluster_spec("h200")


def _plan(preset, dp, cost_model):
    par = ParallelSpec(dp=dp)
    return par, plan_stage(PRESETS[preset], par, cost_model, "greedy", bucket_size=megatron_bucket_size(dp, True))


@pytest.fixture(scope="module")
def one_gpu(h200):
    return _plan("qwen7b-4l", 1, h200[0])


def _sim(h200, case, **kw):
    par, plan = case
    return simulate_overlap(PRESETS["qwen7b-4l" if par.dp_size == 1 else "qwen2.5-7b"], par, h200[1], h200[0],
                            plan=plan, planner="greedy", **kw)


def test_compute_model_reproduces_its_calibration_run():
    """4 micro-batches of the 4-layer Qwen2.5-7B-shaped GPT: Megatron-LM printed 453.6 TFLOP/s at
    239.6 ms (our FLOP count is its count), and forward + backward = 239 - 16 = 223 ms at model_tflops."""
    flops = iteration_flops(PRESETS["qwen7b-4l"], ParallelSpec(dp=1), micro_batches=4)
    assert flops / 0.2396 / 1e12 == pytest.approx(453.6, abs=0.2)
    assert flops / (model_tflops("H200") * 1e9) == pytest.approx(CALIBRATION["forward_backward_ms"], rel=0.01)
    segs = forward_segments(PRESETS["qwen2.5-7b"], ParallelSpec(dp=8), 487.0)
    assert [s.name for s in segs[:3]] == ["embedding", "layer0.qkv", "layer0.attn"] and segs[-1].name == "output"
    assert all(s.bwd_ms == pytest.approx(2 * s.fwd_ms) for s in segs)
    assert sum(s.fwd_ms for s in segs) == pytest.approx(125.8, abs=0.5)  # 28 layers + 152k-vocab head, seq 4096
    half = forward_segments(PRESETS["qwen2.5-7b"], ParallelSpec(tp=2, dp=4), 487.0)
    assert sum(s.fwd_ms for s in half) == pytest.approx(sum(s.fwd_ms for s in segs) / 2)
    with pytest.raises(ValueError, match="dense GPTs"):
        forward_segments(PRESETS["tiny-moe"], ParallelSpec(dp=2), 100.0)


def test_need_groups_follow_megatrons_all_gather_chain(one_gpu):
    _, plan = one_gpu
    groups, param_need = need_groups(plan)
    layout = plan["layouts"]["dense"]
    assert len(groups) == len(layout.buckets) == 10
    assert [g["bucket"] for g in groups] == list(range(9, -1, -1))  # last bucket needed first
    assert param_need["embedding.word_embeddings.weight"] == 0 and param_need["output_layer.weight"] == 9
    assert [g["next"] for g in groups] == list(range(1, 10)) + [None]


def test_eta_zero_hides_nothing_but_pays_the_stack_cut(h200, one_gpu):
    """1 GPU, no all-gather to wait on: with eta 0 the NS only runs where it ran before, so on =
    off + the stack cut, and the backward start gains nothing."""
    r = _sim(h200, one_gpu, eta=0.0)
    e = r["exposed_ns_ms"]
    assert e["off"] == pytest.approx(r["owner_ns_off_ms"])
    assert r["stack_cut_ms"] == pytest.approx(r["owner_ns_cut_ms"] - r["owner_ns_off_ms"]) and 3 < r["stack_cut_ms"] < 12
    assert e["on"] == pytest.approx(e["off"] + r["stack_cut_ms"])
    assert e["on_backward_start"] == pytest.approx(e["on"])
    assert r["hidden_fraction"]["on"] < 0


def test_eta_one_and_a_long_forward_hide_all_but_the_first_groups(h200, one_gpu):
    """At full co-run speed and a slow model, only what the forward waits for before its first
    kernel stays exposed: the first group, and (Megatron's prefetch finishes group k + 1 at group
    k's pre-hook) the second; with the backward start, nothing."""
    par, plan = one_gpu
    _, param_need = need_groups(plan)
    work = group_ns_ms(plan, par, h200[0], param_need)[0]
    r = _sim(h200, one_gpu, eta=1.0, tflops=5.0)
    assert r["exposed_ns_ms"]["on"] == pytest.approx(work[0] + work[1], rel=1e-6)
    assert r["exposed_ns_ms"]["on"] < 0.25 * r["exposed_ns_ms"]["off"]
    lazy = _sim(h200, one_gpu, eta=1.0, tflops=5.0, prefetch_waits=False)
    assert lazy["exposed_ns_ms"]["on"] == pytest.approx(work[0], rel=1e-6)
    assert r["exposed_ns_ms"]["on_backward_start"] == pytest.approx(0.0, abs=1e-6)
    assert r["hidden_fraction"]["on_backward_start"] == pytest.approx(1.0)


@pytest.mark.parametrize("preset_dp", [("qwen7b-4l", 1), ("qwen2.5-7b", 8), ("qwen2.5-7b", 64)])
def test_monotone_in_eta_backward_start_never_worse_never_negative(h200, preset_dp):
    case = _plan(*preset_dp, h200[0])
    prev = None
    for eta in ETAS:
        e = _sim(h200, case, eta=eta)["exposed_ns_ms"]
        assert min(e.values()) >= -1e-9, (eta, e)
        assert e["on_backward_start"] <= e["on"] + 1e-9, (eta, e)
        if prev is not None:
            assert e["on"] <= prev["on"] + 1e-9 and e["on_backward_start"] <= prev["on_backward_start"] + 1e-9, (eta, e, prev)
            assert e["off"] == pytest.approx(prev["off"])
        prev = e


def test_the_dp8_qwen_point_hides_part_of_the_ns(h200):
    """DP 8, Qwen2.5-7B, eta 0.25: 7 bucket groups; 'on' hides part, the backward start all of it
    (the numbers of docs/load_balancing.md's overlap table, greedy plan here)."""
    r = _sim(h200, _plan("qwen2.5-7b", 8, h200[0]), eta=0.25)
    assert r["need_groups"] == 7
    assert 0.2 < r["hidden_fraction"]["on"] < 0.6
    assert r["exposed_ns_ms"]["on_backward_start"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="eta"):
        _sim(h200, _plan("qwen7b-4l", 1, h200[0]), eta=1.5)


def test_plan_cli_overlap_step_prints_and_refuses_by_flag(capsys):
    from megatron_dmuon.planning.plan_cli import main

    base = ["--preset", "qwen7b-4l", "--dp", "1", "--planners", "greedy", "--profile", BENCH]
    assert main(base + ["--overlap-step", "on", "--overlap-eta", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "simulated optimizer step" in out and "exposed NS per iteration: off" in out and "eta 0.50" in out
    assert main(base + ["--overlap-step", "on", "--micro-batches", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["overlap"]["micro_batches"] == 16 and report["overlap"]["eta"] == 0.25
    assert report["bucket_size"] == 40_000_000  # --overlap-grad-reduce's buckets
    for bad in (["--overlap-eta", "1.5"], ["--micro-batches", "0"], ["--model-tflops", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(base + ["--overlap-step", "on", *bad])
        assert exc.value.code == 2
        assert bad[0] in capsys.readouterr().err


def test_plan_cli_picks_the_layout_an_overlapped_run_takes(capsys):
    # 7B at DP 64: the synchronous step's pick is the split layout; an overlapped run keeps whole matrices
    # (they pad the buffers 1.28x, under 1.5x), and dmuon plan --overlap-step on says so
    from megatron_dmuon.planning.plan_cli import main

    picks = {}
    for step in ("off", "on"):
        assert main(["--preset", "qwen2.5-7b", "--dp", "64", "--instances", "1", "--overlap-step", step, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)["dp_layouts"]
        picks[step] = [c["scheme"] for c in report["candidates"] if c["run_choice"]]
        assert ("the step overlapped" in report["why"]) == (step == "on")
    assert picks == {"off": ["split"], "on": ["whole"]}


def test_the_pipelined_publish_waits_for_every_gpus_group_and_the_all_gather_before():
    from megatron_dmuon.planning.simulate_overlap import pipelined_publish_ms

    # GPU 0 runs groups 0 and 1 (3 + 1 ms), GPU 1 group 1 (5 ms), from ms 2; three all-gathers; group 1's way back
    ns = [{0: 3.0, 1: 1.0}, {1: 5.0}]
    # group 0: ready at 5 (GPU 1 has nothing up to it) -> 9; group 1: ready at 7 < 9 -> 9 + 0.5 + 4; group 2: + 1
    assert pipelined_publish_ms(2.0, ns, {1: 0.5}, [4.0, 4.0, 1.0]) == pytest.approx(14.5)
    # a GPU's group waits for its earlier groups (its NS stream is in need order): GPU 1's group 1 now follows
    # 10 ms of group 0, so group 1 is published at 2 + 10 + 5 + 0.5 + 4
    assert pipelined_publish_ms(2.0, [{0: 3.0, 1: 1.0}, {0: 10.0, 1: 5.0}], {1: 0.5}, [4.0, 4.0, 1.0]) == \
        pytest.approx(2 + 15 + 0.5 + 4 + 1)
    # no NS: the start, the ways back and the all-gathers one after the other; never less than that
    assert pipelined_publish_ms(2.0, [{}, {}], {1: 0.5}, [4.0, 4.0, 1.0]) == pytest.approx(11.5)
    assert pipelined_publish_ms(0.0, [{0: 0.1}], {}, [4.0]) == pytest.approx(4.1)


def test_the_split_exchange_apart_in_its_two_ways_and_per_need_group():
    from megatron_dmuon.planning.split_layout import exchange_ms, exchange_ways_ms, narrow_directions

    spec = cluster_spec("h200")
    par = ParallelSpec(dp=128)
    plan = plan_stage(PRESETS["qwen2.5-7b"], par, CostModel(device_spec("H200")), "split",
                      bucket_size=megatron_bucket_size(128, True))
    layout = plan["layouts"]["dense"]
    links = (layout, spec.intra, spec.inter, 8)
    narrow = narrow_directions([p.name for p in plan["params"]["dense"] if p.is_matrix], 1)
    there, back = exchange_ways_ms(*links, narrow=narrow)
    assert [a + b for a, b in zip(there, back)] == pytest.approx(exchange_ms(*links, narrow=narrow))
    assert max(back) < max(there)  # 16-bit directions back, fp32 pieces there
    assert max(exchange_ways_ms(*links)[1]) == pytest.approx(max(there))  # fp32 both ways: the same rounds
    # one need group's exchange alone: only its matrices move; the groups one after the other take longer
    # than all at once (each group's few homes carry it on their own links)
    _, param_need = need_groups(plan)
    by_need = {}
    for p in plan["params"]["dense"]:
        if p.is_matrix:
            by_need.setdefault(param_need[p.name], set()).add(p.name)
    per_group = [exchange_ways_ms(*links, narrow=narrow, matrices=names) for names in by_need.values()]
    assert all(max(t) <= max(there) + 1e-9 for t, _ in per_group)
    assert sum(max(b) for _, b in per_group) > max(back)
    assert exchange_ways_ms(*links, matrices=set()) == ([0.0] * 128, [0.0] * 128)
