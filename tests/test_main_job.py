"""The README's main job: examples/pretrain_gpt.py under torchrun on 2 CPU ranks (gloo)."""
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(tmp_path, *extra):
    out = tmp_path / "timing.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "pretrain_gpt.py"), "--train-iters", "16", "--log-interval", "4",
           "--seq-length", "64", "--timing-json", str(out), *extra]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " iteration       16/      16 | consumed samples:" in proc.stdout
    return {**json.loads(out.read_text()), "stdout": proc.stdout}


def test_main_job_trains_on_stdlib_bytes(tmp_path):
    trace = tmp_path / "optimizer_step.json"
    run = _torchrun(tmp_path, "--profile-optimizer-at", "3", "--profile-out", str(trace))
    summary = run["summary"]
    assert summary["dp"] == 2 and summary["mode"] == "dmuon"
    assert summary["last_loss"] < summary["first_loss"] - 1.0, summary
    # what NS ran, per matrix shape ('auto' is standard NS off CUDA; Megatron's bf16 NS precision)
    assert len(summary["ns_paths"]) >= 3 and set(summary["ns_paths"].values()) == {"standard bfloat16 you x5"}, summary
    # the profiled step: a kernel/op table with the owner step's phases, and a Chrome trace
    table = run["stdout"].split("> profile of the optimizer step", 1)[1]
    assert all(phase in table for phase in ("dmuon.adamw", "dmuon.momentum", "dmuon.ns", "dmuon.apply"))
    assert "traceEvents" in trace.read_text()
    # the run's plan is in its timing JSON, and dmuon plan --show reads it back (validated)
    from megatron_dmuon.planning.plan import DMuonPlan
    from megatron_dmuon.planning.plan_cli import show_plan

    plan = DMuonPlan.from_json(json.dumps(run["dmuon_plan"]))
    qkv = next(r for r in plan.matrices() if r.name.endswith("linear_qkv.weight"))
    assert qkv.split.kind == "qkv" and len(qkv.pieces) == 3 and qkv.dp_owner in (0, 1)
    assert not plan.record("embedding.word_embeddings.weight").use_muon
    assert show_plan(str(tmp_path / "timing.json")).endswith(f"{len(plan.matrices())} Muon matrices, "
                                                               f"{len(plan.records) - len(plan.matrices())} AdamW params, "
                                                               f"{len(plan.layouts)} buffers")


def test_main_job_reads_a_megatron_indexed_dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(40):  # documents with a learnable pattern: counting mod 50
        start = int(rng.integers(0, 50))
        builder.add_document(np.array([(start + i) % 50 for i in range(300)], dtype=np.int32), [300])
    builder.finalize(prefix + ".idx")
    summary = _torchrun(tmp_path, "--data-path", prefix, "--vocab-size", "64", "--dmuon-ranks-per-node", "1")["summary"]
    assert summary["last_loss"] < summary["first_loss"] - 1.0, summary


def test_main_job_passes_decoupled_lr_to_megatron():
    """--decoupled-lr reaches Megatron's OptimizerConfig, whose param-group overrides give the
    embedding and output layer their own max/min lr (the scheduler then follows them)."""
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

    from megatron_dmuon.megatron.config import config_from_args

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import pretrain_gpt
    finally:
        sys.path.pop(0)
    args = pretrain_gpt.parse_args(["--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-5"])
    config = config_from_args(OptimizerConfig, args)
    assert (config.decoupled_lr, config.decoupled_min_lr) == (1e-4, 1e-5)
    overrides = [o for o in get_standard_config_overrides(config).values() if "max_lr" in o]
    assert overrides == [{"max_lr": 1e-4, "min_lr": 1e-5}], overrides
