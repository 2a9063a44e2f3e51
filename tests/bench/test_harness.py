"""bench/harness.py, the one runner of bench/: the timing JSON read back, one retry of a transient
failure, errors with the output's tail, timeouts, the --jobs pool; and Megatron-LM's runs going
through it (bench/megatron_lm_compare.py), and Megatron-Bridge's (bench/bridge.py). Fake programs stand in for the jobs (seconds, no torchrun)."""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest

from tests import ROOT
sys.path.insert(0, os.path.join(ROOT, "bench"))
import harness  # noqa: E402  (bench/harness.py)
import megatron_lm_compare  # noqa: E402
import bridge as bench_bridge  # noqa: E402  (bench/bridge.py; Bridge itself is imported only by its runs)

sys.path.pop(0)

# A stand-in for the main job: writes --timing-json, fails as told by its flags
FAKE_JOB = """
import json, os, sys, time
argv = sys.argv[1:]
if "--sleep" in argv:
    time.sleep(float(argv[argv.index("--sleep") + 1]))
if "--fail-once" in argv:
    marker = argv[argv.index("--fail-once") + 1]
    if not os.path.exists(marker):
        open(marker, "w").close()
        sys.exit("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
if "--fail" in argv:
    print("some progress")
    sys.exit("ValueError: a deterministic failure")
if "--timing-json" in argv:
    with open(argv[argv.index("--timing-json") + 1], "w") as f:
        json.dump({"summary": {"last_loss": 1.5, "rank": os.environ.get("RANK"), "port": os.environ.get("MASTER_PORT")},
                   "iterations": [{"loss": 2.0}, {"loss": 1.5}], "validation": []}, f)
print("done")
"""


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "fake_job.py"
    path.write_text(FAKE_JOB)
    return [str(path)]


def test_the_main_job_is_named_once_in_bench():
    """bench/ launches the trainer's own module (no shim script): only harness.py names it."""
    hits = []
    for name in sorted(os.listdir(os.path.join(ROOT, "bench"))):
        if name.endswith((".py", ".sh")):
            text = open(os.path.join(ROOT, "bench", name)).read()
            assert "examples/pretrain_gpt" not in text and '"examples", "pretrain_gpt.py"' not in text, name
            if "megatron_dmuon.megatron.train\"" in text or "megatron_dmuon.testing.cpu_train\"" in text:
                hits.append(name)
    assert hits == ["harness.py"]
    assert harness.main_job(gpu=True) == ["-m", "megatron_dmuon.megatron.train"]
    assert harness.main_job(gpu=False) == ["-m", "megatron_dmuon.testing.cpu_train"]
    assert harness.main_job() == harness.main_job(gpu=harness.has_cuda()) == harness.Job([]).program


def test_the_main_job_module_is_the_entry_with_main():
    """main_job_module (bench/momentum_spectra.py runs the job in its own process): the entry's ``main``."""
    gpu = harness.main_job_module(gpu=True)
    assert gpu.__name__ == "megatron_dmuon.megatron.train.__main__" and callable(gpu.main)
    cpu = harness.main_job_module(gpu=False)
    assert cpu.__name__ == "megatron_dmuon.testing.cpu_train" and callable(cpu.main)


def test_timing_json_is_read_back(fake, tmp_path):
    r = harness.run(harness.Job(["--x"], program=fake, launch="single", timing_json=True))
    assert r["ok"] and r["attempts"] == 1 and r["timing"]["summary"]["last_loss"] == 1.5
    # one process of its own: rank 0 of 1 with a rendezvous port
    assert r["timing"]["summary"]["rank"] == "0" and int(r["timing"]["summary"]["port"]) > 0
    assert r["command"][-2] == "--timing-json" and not os.path.exists(r["command"][-1])  # a temporary file, removed
    path = str(tmp_path / "t.json")
    harness.run(harness.Job([], program=fake, launch="single", timing_json=path))
    again = harness.run(harness.Job(["--fail"], program=fake, launch="single", timing_json=path, reuse=True))
    assert again["ok"] and again["reused"] and again["timing"]["iterations"][-1]["loss"] == 1.5


def test_a_transient_failure_is_tried_once_more_and_others_are_not(fake, tmp_path):
    marker = str(tmp_path / "marker")
    r = harness.run(harness.Job(["--fail-once", marker], program=fake, launch="single", timing_json=True,
                                retry_wait_s=0))
    assert r["ok"] and r["attempts"] == 2
    r = harness.run(harness.Job(["--fail"], program=fake, launch="single", timing_json=True, retry_wait_s=0,
                                log=str(tmp_path / "run.log")))
    assert not r["ok"] and r["attempts"] == 1 and r["timing"] is None
    assert r["error"].rstrip().endswith("ValueError: a deterministic failure") and "some progress" in r["error"]
    assert "a deterministic failure" in (tmp_path / "run.log").read_text()


def test_a_run_past_its_timeout_is_stopped_and_reported(fake):
    start = time.time()
    r = harness.run(harness.Job(["--sleep", "60"], program=fake, launch="single", timeout=1))
    assert time.time() - start < 30
    assert not r["ok"] and r["returncode"] is None and "stopped after 1 s" in r["error"]


def test_torchrun_command():
    cmd = harness.command(harness.Job(["--a", "1"], nproc=4), "/tmp/t.json")
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    assert cmd[6:] == [*harness.main_job(), "--a", "1", "--timing-json", "/tmp/t.json"]
    assert cmd[6:8] == ["-m", "megatron_dmuon.megatron.train" if harness.has_cuda() else "megatron_dmuon.testing.cpu_train"]
    single = harness.command(harness.Job(["--a"], program=harness.main_job(gpu=True), launch="single"))
    assert single[1:] == ["-m", "megatron_dmuon.megatron.train", "--a"]
    assert harness.launch_for(1, gpu=True) == "single" and harness.launch_for(2, gpu=True) == "torchrun"
    assert harness.launch_for(1, gpu=False) == "torchrun"


def test_pool_keeps_order_and_starts_nothing_past_its_deadline():
    done = []
    out = harness.in_parallel(lambda x: (time.sleep(0.05 * (3 - x)), x * x)[1], [0, 1, 2], jobs=3,
                              on_done=lambda item, result: done.append(item))
    assert out == [0, 1, 4] and sorted(done) == [0, 1, 2]
    out = harness.in_parallel(lambda x: x, [1, 2], jobs=1, deadline=time.time() - 1,
                              not_started=lambda x: {"error": f"not started {x}"})
    assert out == [{"error": "not started 1"}, {"error": "not started 2"}]


def test_megatron_lm_runs_go_through_the_harness(tmp_path, monkeypatch):
    """megatron_lm_compare.run: Megatron-LM's pretrain_gpt.py under torchrun from its checkout, DMuon on the
    path, multicast off, the log written, Megatron's progress lines parsed from the output."""
    seen = []
    line = (" [2026-11-30 20:01:02] iteration {i:8d}/      30 | elapsed time per iteration (ms): 500.0 | "
            "throughput per GPU (TFLOP/s/GPU): 10.0 | lm loss: {loss:E} | grad norm: 1.0 | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |")

    def fake_run(job, capture=True):
        seen.append(job)
        return {"ok": True, "returncode": 0, "output": "\n".join(line.format(i=i, loss=10 - i) for i in (1, 2)),
                "stdout": "", "timing": None}

    monkeypatch.setattr(harness, "run", fake_run)
    args = SimpleNamespace(nproc=2, model="small", iters=2, extra=["--x"], timeout=7, qk_clip=1.5,
                           transformer_impl="local", fp8_format=None, gradient_accumulation_fusion=False)
    r = megatron_lm_compare.run("dmuon", args, str(tmp_path), str(tmp_path), label="d", more=("--seed", "3"))
    (job,) = seen
    assert job.program == ["-m", "megatron_dmuon.testing.local_max_logits", str(tmp_path / "pretrain_gpt.py")]
    assert job.nproc == 2 and job.cwd == str(tmp_path) and job.timeout == 7 and job.log == str(tmp_path / "d.log")
    assert job.flags[-6:] == ["--x", "--seed", "3", "--qk-clip", "--qk-clip-threshold", "1.5"]
    assert job.env["NCCL_NVLS_ENABLE"] == "0" and job.env["PYTHONPATH"].split(os.pathsep)[:2] == [ROOT, str(tmp_path)]
    assert [it["loss"] for it in r["iterations"]] == [9.0, 8.0] and r["median_ms"] == 500.0
    args.qk_clip = None  # any other run: DMuon's launcher on the unmodified script
    megatron_lm_compare.run("adam", args, str(tmp_path), str(tmp_path))
    assert seen[-1].program == ["-m", "megatron_dmuon.megatron.run", str(tmp_path / "pretrain_gpt.py")]


def test_bridge_runs_go_through_the_harness(tmp_path, monkeypatch):
    """bench/bridge.py's ``one``: its own ``run`` under torchrun through harness.run (one rank, the log written,
    the repository on PYTHONPATH), its JSON read back; a failed run returns the output's tail. The band's
    concurrent runs go through harness.in_parallel."""
    seen = []

    def fake_run(job, capture=True):
        seen.append(job)
        out = job.flags[job.flags.index("--out") + 1]
        if "--fail" in job.flags:
            return {"ok": False, "returncode": 1, "output": "progress\nRuntimeError: boom", "wall_s": 1.0}
        with open(out, "w") as f:
            f.write('{"rows": [{"iteration": 1, "ms": 5.0, "loss": {"lm loss": 2.5}}], "optimizer": "X"}')
        return {"ok": True, "returncode": 0, "output": "", "wall_s": 2.0}

    monkeypatch.setattr(harness, "run", fake_run)
    doc = bench_bridge.one(str(tmp_path), "a", ["--optimizer", "dmuon"], timeout=11)
    (job,) = seen
    assert job.program == [os.path.join(ROOT, "bench", "bridge.py")] and job.nproc == 1 and job.launch == "torchrun"
    assert job.flags == ["run", "--out", str(tmp_path / "a.json"), "--optimizer", "dmuon"]
    assert job.timeout == 11 and job.log == str(tmp_path / "a.log")
    assert job.env["PYTHONPATH"].split(os.pathsep)[0] == ROOT
    assert doc["name"] == "a" and doc["wall_s"] == 2.0 and bench_bridge.lm_loss(doc["rows"][0]) == 2.5
    failed = bench_bridge.one(str(tmp_path), "b", ["--fail"])
    assert failed == {"name": "b", "error": "progress\nRuntimeError: boom"}
    # the band stage: every (model, optimizer, seed) run through the pool, results by job
    seen.clear()
    args = SimpleNamespace(out_dir=str(tmp_path), band_models=["small"], band_iters=3, jobs=2)
    results = {}
    assert bench_bridge.stage_band(args, results, lambda text: None)
    assert len(seen) == 6 and sorted(results["band"]) == sorted(f"small/{o}/{s}" for o in ("muon", "dmuon")
                                                                  for s in (1, 2, 3))
