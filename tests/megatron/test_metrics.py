"""DMuon's metrics in TensorBoard (and W&B) through the writers a Megatron user already has
([metrics], docs/metrics.md, megatron/metrics.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from megatron_dmuon.megatron.metrics import METRICS, NAMES
from megatron_dmuon.testing.multiproc import run_distributed, run_main_job

from tests import ROOT
SMALL = ["--seq-length", "32", "--hidden-size", "64", "--ffn-hidden-size", "128", "--global-batch-size", "8",
         "--micro-batch-size", "2", "--lr-warmup-iters", "1", "--eval-iters", "0"]


def metrics_table() -> str:
    """The markdown table of every metric, as docs/metrics.md has it."""
    lines = ["| name | unit | rank | what |", "|---|---|---|---|"]
    lines += [f"| `{m.name}` | {m.unit} | {m.rank} | {m.what} |" for m in METRICS]
    return "\n".join(lines)


def test_the_table_in_the_docs_is_the_codes():
    assert metrics_table() in open(os.path.join(ROOT, "docs", "metrics.md")).read()
    assert len(set(NAMES)) == len(NAMES) and all(n.startswith("dmuon/") for n in NAMES)


def has_wandb() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    """One main-job run writing to TensorBoard and, where the package is installed, to W&B offline
    (the run files stay in --wandb-save-dir)."""
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (pip install tensorboard)")
    out = tmp_path_factory.mktemp("tb")
    wandb_flags = ["--wandb-project", "dmuon-test", "--wandb-save-dir", str(out / "wb")] if has_wandb() else []
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # (no key needed: test_wandb_offline_run_files)
    proc = run_main_job([*SMALL, "--train-iters", "4", "--log-interval", "2", "--dmuon-ns-check-interval", "1",
                         "--tensorboard-dir", str(out / "tb"), *wandb_flags], env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "tb", proc.stdout, (out / "wb" if wandb_flags else None)


def printed_metrics(stdout: str) -> list:
    """The ``> dmuon metrics {...}`` lines rank 0 prints at each logged iteration."""
    return [json.loads(line.split(" ", 3)[3]) for line in stdout.splitlines() if line.startswith("> dmuon metrics ")]


def wandb_history(path) -> list:
    """Every history row of an offline W&B run file (``run-*.wandb``), read as W&B writes it: after a
    7-byte ':W&B' header, LevelDB-log records in 32 KiB blocks ([crc:4][length:2][type:1][data]; type 1
    whole, 2/3/4 first/middle/last piece), each record a ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_the_main_job_writes_every_metric_at_every_log_interval(tensorboard_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, stdout, _ = tensorboard_run
    printed = printed_metrics(stdout)
    assert [p["iteration"] for p in printed] == [1, 2, 4]  # the logged iterations (the first, then every 2nd)
    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(NAMES) | {"lm loss", "learning-rate"} <= tags, set(NAMES) - tags
    for name in NAMES:
        scalars = {e.step: e.value for e in events.Scalars(name)}
        assert sorted(scalars) == [1, 2, 4], (name, scalars)
        for line in printed:  # what the charts hold is what the run printed
            assert scalars[line["iteration"]] == pytest.approx(line[name], rel=1e-6, abs=1e-6), name
    last = printed[-1]
    assert last["dmuon/optimizer_ms_slowest_rank"] >= last["dmuon/optimizer_ms_mean_rank"] > 0
    assert last["dmuon/rank_imbalance"] >= 1.0 and last["dmuon/ns_check_worst"] > -1.0
    assert last["dmuon/publish_bytes"] > 0 and last["dmuon/skipped_iterations"] == 0


def test_the_main_job_writes_every_metric_to_wandb_offline_at_every_log_interval(tensorboard_run):
    _, stdout, save_dir = tensorboard_run
    if save_dir is None:
        pytest.skip("the wandb package is not installed (pip install wandb)")
    runs = sorted(save_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs  # rank 0 writes, offline: no API key
    history = {row["_step"]: row for row in wandb_history(runs[0])}
    printed = printed_metrics(stdout)
    assert sorted(history) == [p["iteration"] for p in printed] == [1, 2, 4]
    for line in printed:  # what W&B holds is what the run printed
        row = history[line["iteration"]]
        assert set(NAMES) | {"lm loss", "learning-rate"} <= set(row), set(NAMES) - set(row)
        for name in NAMES:
            assert row[name] == pytest.approx(line[name], rel=1e-6, abs=1e-6), name


def test_the_metrics_read_no_device_value_inside_the_step():
    from megatron_dmuon.testing.multiproc import run_distributed

    results = run_distributed("megatron_dmuon.testing.guard_workers:metrics_device_reads", 2,
                              kwargs=dict(steps=4, shape_kw=dict(num_layers=1), muon_kw=dict(ns_check_interval=2)))
    for r in results:
        assert r["on"] == r["off"], r  # the step reads back what it read before, nothing more
        assert set(NAMES) - {"dmuon/ns_check_worst"} <= set(r["values"])
        assert r["values"]["dmuon/ns_matrices"] >= 0 and r["values"]["dmuon/optimizer_ms"] > 0


def test_the_megatron_lm_hook_writes_the_same_names_into_megatrons_writers(monkeypatch):
    # route 9 (megatron/megatron_lm.py): after Megatron-LM's training_log, at every --log-interval
    import megatron_dmuon.megatron.megatron_lm as hook

    written = []

    class Writer:
        def add_scalar(self, name, value, step):
            written.append((name, value, step))

        def flush(self):
            pass

    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_tensorboard_writer, global_vars.get_wandb_writer = Writer, lambda: None
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    metrics = types.SimpleNamespace(values=lambda: {name: float(i) for i, name in enumerate(NAMES)})
    monkeypatch.setitem(hook._RUN, "metrics", metrics)
    log = hook._with_dmuon_metrics(lambda *a, **k: "megatron's", types.SimpleNamespace(log_interval=5))
    assert log({}, {}, 1e-3, 4, 1.0) == "megatron's" and written == []  # not a log iteration
    assert log({}, {}, 1e-3, 10, 1.0) == "megatron's"
    assert [(n, s) for n, _, s in written] == [(n, 10) for n in NAMES]


def _real_tree():
    from tests.megatron.test_megatron_lm import _built_checkout

    return _built_checkout()


@pytest.mark.skipif(_real_tree() is None,
                    reason="needs a Megatron-LM checkout with megatron/core/datasets/helpers_cpp built (make -C there)")
def test_the_hook_writes_every_metric_through_megatron_lms_own_writers_on_a_real_tree(tmp_path):
    """Route 9 on a real Megatron-LM tree: its own argument parsing makes the TensorBoard writer (and W&B's,
    offline, where the package is installed) on the last rank, its own train_step steps DMuon on 2 gloo
    ranks and its own training_log (wrapped by the hook) logs every iteration; every documented name is in
    the event file at every --log-interval, with the same value in W&B's run file."""
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.megatron.test_megatron_lm import HERE, tree_pythonpath

    checkout = _real_tree()
    wandb_flags = (["--wandb-project", "dmuon-test", "--wandb-exp-name", "hook", "--wandb-save-dir", str(tmp_path / "wb")]
                   if has_wandb() else [])
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
            "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 1e-3 --mock-data --tokenizer-type "
            "NullTokenizer --vocab-size 1000 --transformer-impl local --no-rope-fusion --no-bias-swiglu-fusion "
            "--no-bias-dropout-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion "
            "--no-masked-softmax-fusion --attention-backend unfused --swiglu --normalization RMSNorm "
            "--position-embedding-type rope --disable-bias-linear --use-cpu-initialization --eval-iters 0 "
            "--eval-interval 1000 --use-distributed-optimizer --muon-momentum 0.95 --muon-nesterov --optimizer dmuon "
            "--log-interval 2 --dmuon-ns-check-interval 1").split() + ["--tensorboard-dir", str(tmp_path / "tb"),
                                                                      *wandb_flags]
    env = {"PYTHONPATH": tree_pythonpath(checkout, HERE), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = run_distributed("megatron_lm_workers:megatron_train_step", 2, timeout=900, env=env, sys_path=[HERE, checkout],
                          kwargs={"argv": argv, "log": True})
    assert out[0]["logged"] == [1, 2, 3, 4] and out[0]["optimizers"] == ["DMuonDistributedOptimizer"]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(NAMES) | {"lm loss", "learning-rate"} <= tags, set(NAMES) - tags  # Megatron's own names beside
    charts = {name: {e.step: e.value for e in events.Scalars(name)} for name in NAMES}
    for name, steps in charts.items():
        assert sorted(steps) == [2, 4], (name, steps)  # every --log-interval, nothing between
    assert charts["dmuon/optimizer_ms_slowest_rank"][4] >= charts["dmuon/optimizer_ms_mean_rank"][4] > 0
    assert charts["dmuon/publish_bytes"][4] > 0 and charts["dmuon/skipped_iterations"][4] == 0
    if wandb_flags:
        files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "wb") for f in fs if f.endswith(".wandb")]
        assert len(files) == 1, files
        rows = [r for r in wandb_history(files[0]) if "dmuon/optimizer_ms_mean_rank" in r]
        assert [r["_step"] for r in rows] == [2, 4]
        for row in rows:
            for name in NAMES:
                assert row[name] == pytest.approx(charts[name][row["_step"]], rel=1e-6, abs=1e-6), name


def test_wandb_offline_run_files(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="the wandb package is not installed (pip install wandb)")
    from megatron_dmuon.megatron.metrics import wandb_run, write_values

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = wandb_run("dmuon-test", "metrics", str(tmp_path), {})
    write_values(2, {name: 1.0 for name in NAMES}, wandb=run)
    run.finish()
    assert any(p.name.startswith("offline-run") for p in (tmp_path / "wandb").iterdir())
    del wandb


def test_a_missing_package_is_named():
    from megatron_dmuon.megatron import metrics

    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install wandb"):
            metrics.wandb_run("p", None, None, {})
    assert [m.name for m in METRICS] == list(NAMES)


def test_dmuon_plan_draws_its_plans(tmp_path):
    # dmuon plan --plot: each GPU's predicted NS and bytes under each planner, the DP layouts' candidates
    from megatron_dmuon.planning.plan_cli import main

    path = tmp_path / "plan.png"
    assert main(["--preset", "tiny", "--dp", "4", "--planners", "greedy", "split", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_bench_scaling_redraws_its_plot_from_its_json(tmp_path):
    # bench/scaling.py simulate --plot-only: the picture (DMuon's predicted step and Megatron's AdamW vs GPUs)
    # from a written report, without planning again; a missing report is a one-line usage error
    import shutil

    src = os.path.join(ROOT, "docs", "results", "scaling", "simulate_scaling_cpu_2026-12-01.json")
    shutil.copy(src, tmp_path / "s.json")
    script = os.path.join(ROOT, "bench", "scaling.py")
    env = dict(os.environ, MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, script, "simulate", "--plot-only", "--out", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, script, "simulate", "--plot-only", "--out", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=300, env=env)
    assert missing.returncode == 2 and "--out" in missing.stderr and "Traceback" not in missing.stderr
