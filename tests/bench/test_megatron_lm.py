"""bench/megatron_lm_compare.py (a GPU benchmark): its log parser on Megatron-LM's progress-line
format, and (with a Megatron-LM checkout around) every run's command line through Megatron-LM's own
parser with the hook installed, so the GPU run cannot die on a flag."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import megatron_lm_compare as bench  # noqa: E402
import megatron_lm_switch as switch  # noqa: E402
import megatron_lm_band as band_tool  # noqa: E402

sys.path.pop(0)

# Megatron-LM core_v0.19.0 training_log's line (one logged iteration), with and without extras
LOG = """\
 [2026-11-30 20:01:02.123456] iteration        1/      30 | consumed samples:            8 | elapsed time per iteration (ms): 31234.5 | throughput per GPU (TFLOP/s/GPU): 12.5 | learning rate: 1.500000E-04 | global batch size:     8 | lm loss: 1.037812E+01 | loss scale: 1.0 | grad norm: 4.211 | number of skipped iterations:   0 | number of nan iterations:   0 |
some other output
 [2026-11-30 20:01:03.123456] iteration        2/      30 | consumed samples:           16 | elapsed time per iteration (ms): 512.3 | throughput per GPU (TFLOP/s/GPU): 455.0 | learning rate: 3.000000E-04 | global batch size:     8 | lm loss: 9.912001E+00 | loss scale: 1.0 | grad norm: 3.100 | number of skipped iterations:   1 | number of nan iterations:   0 |
"""


def test_parse_log_reads_megatrons_progress_lines():
    rows = bench.parse_log(LOG)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[1] == {"iteration": 2, "ms": 512.3, "loss": 9.912001, "grad_norm": 3.1, "tflops": 455.0,
                       "skipped": 1.0, "nan": 0.0}


def test_loss_gap():
    a = {"iterations": [{"loss": 10.0}, {"loss": 9.0}]}
    b = {"iterations": [{"loss": 10.1}, {"loss": 8.95}]}
    gap = bench.loss_gap(a, b)
    assert gap["max_abs"] == pytest.approx(0.1) and gap["last_abs"] == pytest.approx(0.05)


def _checkout():
    path = os.environ.get("DMUON_MEGATRON_LM") or os.path.join(ROOT, ".mlm")
    return path if os.path.isfile(os.path.join(path, "megatron", "training", "arguments.py")) else None


def _pr6683_checkout():
    """Megatron-LM PR #6683's tree (LayerShardedMuon): $DMUON_MEGATRON_LM_PR6683 or .mlm_pr6683/."""
    path = os.environ.get("DMUON_MEGATRON_LM_PR6683") or os.path.join(ROOT, ".mlm_pr6683")
    return path if os.path.isfile(os.path.join(path, "megatron", "training", "arguments.py")) else None


def _tree_for(run):
    return _pr6683_checkout() if run in bench.LSM_RUNS else _checkout()


@pytest.mark.parametrize("run", sorted(bench.RUNS))
def test_every_run_parses_with_megatron_lm(run):
    """(muon_lsm*: on PR #6683's tree, which has --use-layer-sharding-muon; the rest on $DMUON_MEGATRON_LM / .mlm/)"""
    if _tree_for(run) is None:
        pytest.skip("no Megatron-LM checkout ($DMUON_MEGATRON_LM or .mlm/; muon_lsm*: $DMUON_MEGATRON_LM_PR6683 or "
                    ".mlm_pr6683/)")
    argv = [*bench.MODELS["qwen7b-4l"], *bench.COMMON, *bench.NO_TE, "--train-iters", "30", *bench.RUNS[run]]
    script = ("import sys, typing\ntyping.override = getattr(typing, 'override', lambda f: f)\n"
              "import megatron_dmuon.megatron as dm; dm.install()\n"
              "from megatron.training.arguments import parse_and_validate_args\n"
              "args = parse_and_validate_args(args_defaults={'tokenizer_type': 'GPT2BPETokenizer'})\n"
              "print('OK', args.optimizer, args.use_distributed_optimizer, args.log_throughput)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_tree_for(run), ROOT]), WORLD_SIZE="2", RANK="0",
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                          cwd=_tree_for(run), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    optimizer, distributed, throughput = proc.stdout.split("OK ")[-1].split()
    assert optimizer == bench.RUNS[run][1] and throughput == "True"
    # Megatron turns --use-distributed-optimizer into its layer-wise Muon; DMuon and Adam keep it
    assert distributed == ("False" if optimizer == "muon" else "True")


@pytest.mark.skipif(_checkout() is None, reason="no Megatron-LM checkout ($DMUON_MEGATRON_LM or .mlm/)")
@pytest.mark.parametrize("run", ["muon", "dmuon"])
def test_qk_clip_runs_parse_through_the_local_max_logits_launcher_only(run):
    # --qk-clip: Megatron-LM asserts TE >= 2.9; the launcher the bench starts each run through answers
    # that check (its local attention records the logits), and nothing else changes
    argv = [*bench.MODELS["qwen7b-4l"], *bench.COMMON, *bench.NO_TE, "--train-iters", "30", *bench.RUNS[run],
            "--qk-clip", "--qk-clip-threshold", "2.0"]
    script = ("import sys, typing\ntyping.override = getattr(typing, 'override', lambda f: f)\n"
              "if sys.argv[1] == 'launcher':\n"
              "    from megatron_dmuon.testing import local_max_logits; local_max_logits.install()\n"
              "del sys.argv[1]\n"
              "import megatron_dmuon.megatron as dm; dm.install()\n"
              "from megatron.training.arguments import parse_and_validate_args\n"
              "args = parse_and_validate_args(args_defaults={'tokenizer_type': 'GPT2BPETokenizer'})\n"
              "print('OK', args.optimizer, args.qk_clip, args.qk_clip_threshold)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_checkout(), ROOT]), WORLD_SIZE="1", RANK="0",
               PYTHONWARNINGS="ignore")

    def parse(mode):
        return subprocess.run([sys.executable, "-c", script, mode, *argv], capture_output=True, text=True, env=env,
                              cwd=_checkout(), timeout=300)

    ok, plain = parse("launcher"), parse("plain")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.split("OK ")[-1].split() == [run, "True", "2.0"]
    assert plain.returncode != 0 and "--qk-clip is only supported with TE >= 2.9.0" in plain.stderr


def test_report_from_runs(tmp_path, monkeypatch, capsys):
    """The summary the GPU run prints: speed-up and loss gaps against Megatron's Muon, the noise band."""
    def fake_run(name, args, megatron_lm, log_dir, label=None, more=()):
        ms, shift = {"muon": (600.0, 0.0), "muon_fp32ns": (650.0, 0.01), "dmuon": (480.0, 0.004),
                     "dmuon_standard": (500.0, 0.002)}[name]
        rows = [{"iteration": i + 1, "ms": ms, "loss": 10.0 - i * 0.1 + shift * (i % 2), "grad_norm": 1.0,
                 "tflops": 100.0, "skipped": 0.0, "nan": 0.0} for i in range(args.iters)]
        return {"run": name, "iterations": rows, "median_ms": ms, "median_tflops": 100.0, "first_loss": rows[0]["loss"],
                "last_loss": rows[-1]["loss"], "skipped": 0, "nan": 0}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: None)  # patches/apply.sh
    assert bench.main(["--megatron-lm", str(tmp_path), "--iters", "6", "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "megatron_lm_compare.md").read_text()
    assert "| dmuon | 480.0 | 100.0 | 1.250 |" in table and "| 0.0040 |" in table
    assert "dmuon vs muon: max loss gap 0.0040 (bf16 noise band, muon fp32-NS vs bf16-NS: 0.0100); dmuon 1.25x" in table
    summary = __import__("json").loads((tmp_path / "out" / "megatron_lm_compare.json").read_text())["summary"]
    assert summary["runs"]["dmuon_standard"]["loss_gap_to_muon"]["max_abs"] == pytest.approx(0.002)


@pytest.mark.parametrize("version,tree_has_flag,syrk", [("0.4.0", True, True), ("0.3.0", True, False),
                                                       ("0.4.0", False, False), (None, True, False)])
def test_megatrons_syrk_row_joins_where_it_can_run(tmp_path, monkeypatch, capsys, version, tree_has_flag, syrk):
    """muon_syrk (Megatron's Muon with --muon-use-syrk) is a default row where Emerging-Optimizers >= 0.4.0
    imports and the tree has the flag (main); asked for elsewhere it is refused before any run, naming
    why; the table names the Emerging-Optimizers version of Megatron's rows."""
    names = []

    def fake_run(name, args, megatron_lm, log_dir, label=None, more=()):
        names.append(name)
        rows = [{"iteration": i + 1, "ms": 500.0, "loss": 10.0 - i * 0.1, "grad_norm": 1.0, "tflops": 100.0,
                 "skipped": 0.0, "nan": 0.0} for i in range(args.iters)]
        return {"run": name, "iterations": rows, "median_ms": 500.0, "median_tflops": 100.0,
                "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"], "skipped": 0, "nan": 0}

    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "arguments.py").write_text(
        "group.add_argument('--muon-use-syrk', action='store_true')\n" if tree_has_flag else "")
    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "emerging_optimizers_version", lambda: version)
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: None)  # patches/apply.sh
    out = tmp_path / "out"
    assert bench.main(["--megatron-lm", str(tmp_path), "--iters", "4", "--out", str(out)]) == 0
    assert ("muon_syrk" in names) == syrk and set(names) - {"muon_syrk"} == set(bench.DEFAULT_RUNS)
    assert f"Megatron's Muon rows (muon*): Emerging-Optimizers {version or 'not importable'}" in (
        out / "megatron_lm_compare.md").read_text()
    if not syrk:
        with pytest.raises(SystemExit):
            bench.main(["--megatron-lm", str(tmp_path), "--iters", "4", "--runs", "muon", "muon_syrk"])
        assert "--runs muon_syrk: " in capsys.readouterr().err


def _fake_tree(path, flags, commit=None):
    (path / "megatron" / "training").mkdir(parents=True)
    (path / "megatron" / "training" / "arguments.py").write_text(
        "".join(f"group.add_argument('{flag}', action='store_true')\n" for flag in flags))
    if commit:
        (path / "COMMIT").write_text(commit + "\n")
    return str(path)


def test_megatron_lm_for_runs_each_row_on_its_tree(tmp_path, monkeypatch, capsys):
    """--megatron-lm-for RUN=DIR: that run's command line starts DIR's pretrain_gpt.py through DMuon's launcher,
    in DIR, with DIR on PYTHONPATH; every other run on --megatron-lm; each tree patched once; every row names its
    tree and NS path; a run whose tree lacks its flag, or a bad RUN=DIR, is one usage line before any run."""
    main = _fake_tree(tmp_path / "main", ["--muon-use-syrk"])
    pr = _fake_tree(tmp_path / "pr", ["--muon-use-syrk", "--use-layer-sharding-muon"], commit="c10c0996538cad9f3fc6")
    jobs, patched = [], []

    def fake_harness_run(job):
        jobs.append(job)
        iters = int(job.flags[job.flags.index("--train-iters") + 1])
        log = "\n".join(LOG.splitlines()[0].replace("iteration        1/", f"iteration {i:8d}/")
                        for i in range(1, iters + 1))
        return {"output": log, "returncode": 0}

    monkeypatch.setattr(bench.harness, "run", fake_harness_run)
    monkeypatch.setattr(bench, "emerging_optimizers_version", lambda: "0.4.0")
    monkeypatch.setattr(bench.subprocess, "run", lambda argv, **k: patched.append(argv[-1]))  # patches/apply.sh
    runs = ["adam", "muon", "muon_lsm", "muon_lsm_syrk", "dmuon"]
    out = tmp_path / "out"
    assert bench.main(["--megatron-lm", main, "--megatron-lm-for", f"muon_lsm={pr}", "--megatron-lm-for",
                       f"muon_lsm_syrk={pr}", "--runs", *runs, "--iters", "3", "--transformer-impl", "local",
                       "--out", str(out), "--extra", "--global-batch-size", "4"]) == 0
    assert patched == [main, pr]
    assert [j.flags[j.flags.index("--optimizer") + 1] for j in jobs] == ["adam", "muon", "muon", "muon", "dmuon"]
    for name, job in zip(runs, jobs):
        tree = pr if name.startswith("muon_lsm") else main
        assert job.program == ["-m", "megatron_dmuon.megatron.run", os.path.join(tree, "pretrain_gpt.py")]
        assert job.cwd == tree and job.env["PYTHONPATH"].split(os.pathsep)[:2] == [ROOT, tree]
        assert job.flags == [*bench.MODELS["qwen7b-4l"], *bench.COMMON, *bench.NO_TE, "--train-iters", "3",
                             *bench.RUNS[name], "--global-batch-size", "4"]
    lsm = jobs[2].flags
    assert "--use-layer-sharding-muon" in lsm and "--muon-no-split-qkv" in lsm and "--muon-use-syrk" not in lsm
    assert lsm[lsm.index("--muon-ns-batch-size") + 1] == "32"
    syrk = jobs[3].flags
    assert "--muon-use-syrk" in syrk and syrk[syrk.index("--muon-ns-batch-size") + 1] == "1"
    table = (out / "megatron_lm_compare.md").read_text()
    assert "| muon_lsm | " in table and "| pr c10c099653 | PR #6683: EO newton_schulz bf16, batched" in table
    assert "| dmuon | " in table and "| main | DMuon: auto (Gram fp16 wide, standard bf16 square)" in table
    summary = __import__("json").loads((out / "megatron_lm_compare.json").read_text())["summary"]
    assert summary["trees"] == {"adam": "main", "muon": "main", "muon_lsm": "pr c10c099653",
                                "muon_lsm_syrk": "pr c10c099653", "dmuon": "main"}
    # refused before any run, one line naming the flag and the fix
    jobs.clear()
    for argv, said in [(["--runs", "muon", "muon_lsm"], "--runs muon_lsm: the Megatron-LM tree"),
                       (["--runs", "muon_lsm", "--megatron-lm-for", "muon_lsm"], "give RUN=DIR"),
                       (["--runs", "muon", "--megatron-lm-for", f"nope={pr}"], "no run 'nope'"),
                       (["--runs", "muon_lsm", "--megatron-lm-for", f"muon_lsm={tmp_path}"], "is not a Megatron-LM tree"),
                       (["--runs", "muon", "--megatron-lm-for", f"muon_lsm={pr}"], "not among --runs")]:
        with pytest.raises(SystemExit) as e:
            bench.main(["--megatron-lm", main, "--iters", "3", "--transformer-impl", "local", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setattr(bench, "emerging_optimizers_version", lambda: "0.3.0")
    with pytest.raises(SystemExit):
        bench.main(["--megatron-lm", main, "--runs", "muon_lsm_syrk", "--megatron-lm-for", f"muon_lsm_syrk={pr}"])
    assert "--runs muon_lsm_syrk: Megatron's --muon-use-syrk needs Emerging-Optimizers >= 0.4.0" in capsys.readouterr().err
    assert jobs == []


def test_seeds_give_each_run_its_gap_beside_that_seeds_band(tmp_path, monkeypatch):
    """--seeds/--jobs: every run once per seed (the seed reaches Megatron-LM as its last --seed flag, the
    default seed as COMMON's), gaps to that seed's muon, each set beside that seed's band; with --jobs > 1
    the table reports no times."""
    calls = []
    shifts = {(1234, "muon_fp32ns"): 0.002, (1234, "dmuon"): 0.001, (7, "muon_fp32ns"): 0.001, (7, "dmuon"): 0.003}

    def fake_run(name, args, megatron_lm, log_dir, label=None, more=()):
        seed = int(more[1]) if more else bench.DEFAULT_SEED
        calls.append((name, label, tuple(more)))
        shift = shifts.get((seed, name), 0.0)
        rows = [{"iteration": i + 1, "ms": 500.0, "loss": 10.0 - i * 0.1 + shift * (i == 2), "grad_norm": 1.0,
                 "tflops": 100.0, "skipped": 0.0, "nan": 0.0} for i in range(args.iters)]
        return {"run": name, "iterations": rows, "median_ms": 500.0, "median_tflops": 100.0,
                "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"], "skipped": 0, "nan": 0}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: None)  # patches/apply.sh
    out = tmp_path / "out"
    assert bench.main(["--megatron-lm", str(tmp_path), "--iters", "5", "--runs", "muon", "muon_fp32ns", "dmuon",
                       "--seeds", "1234", "7", "--jobs", "3", "--out", str(out)]) == 0
    assert sorted(calls) == sorted([(n, f"{n}_s{s}", () if s == 1234 else ("--seed", "7"))
                                    for s in (1234, 7) for n in ("muon", "muon_fp32ns", "dmuon")])
    summary = __import__("json").loads((out / "megatron_lm_compare.json").read_text())["summary"]
    band = summary["band_over_seeds"]
    assert band["dmuon"]["max_abs_by_seed"] == {"1234": pytest.approx(0.001), "7": pytest.approx(0.003)}
    assert band["dmuon"]["within_band_seeds"] == 1 and band["muon_fp32ns"]["within_band_seeds"] == 2
    assert summary["timed"] is False and "speedup_vs_muon" not in summary["runs_by_seed"]["7"]["dmuon"]
    table = (out / "megatron_lm_compare.md").read_text()
    assert "| seed 7: dmuon | — | — | — |" in table and "| dmuon | 0.0010, 0.0030 | 0.0030 | 0.0020 | 1 / 2 |" in table
    # without dmuon_fp32ns in the runs there is no exact curve to measure against
    assert "gap_to_exact_by_seed" not in summary
    by_seed = {1: {"muon": {"iterations": [{"loss": 1.0}, {"loss": 0.5}]},
                   "dmuon_fp32ns": {"iterations": [{"loss": 1.0}, {"loss": 0.502}]},
                   "dmuon": {"iterations": [{"loss": 1.001}, {"loss": 0.5}]}, "dmuon_standard": {"error": "x"}}}
    assert bench.gaps_to(by_seed, "dmuon_fp32ns") == {"muon": {"1": pytest.approx(0.002)}, "dmuon": {"1": pytest.approx(0.002)}}


def test_switch_report_unfolds_megatrons_first_log_after_a_load(tmp_path, monkeypatch):
    """bench/megatron_lm_switch.py: the switched run is compared iteration by iteration with the run
    that never switched; Megatron-LM's second logged loss after a --load (the mean of the first two)
    is unfolded first, so an exact continuation shows no gap."""
    curve = {i: 10.0 - 0.3 * i for i in range(1, 17)}

    def fake_run(name, args, megatron_lm, log_dir, label=None, more=()):
        start = getattr(args, "start", 0)
        rows = [{"iteration": i, "ms": 100.0, "loss": curve[i] + (1e-4 if start and "dmuon" in name else 0.0)}
                for i in range(start + 1, args.iters + 1)]
        if start and len(rows) > 1:
            rows[1]["loss"] = (rows[0]["loss"] + rows[1]["loss"]) / 2  # Megatron-LM's log after a load
        return {"run": name, "iterations": rows, "median_ms": 100.0}

    monkeypatch.setattr(switch, "run", fake_run)
    monkeypatch.setattr(switch.subprocess, "run", lambda *a, **k: None)  # patches/apply.sh
    assert switch.main(["--megatron-lm", str(tmp_path), "--iters", "16", "--switch-at", "8",
                        "--out", str(tmp_path / "out")]) == 0
    out = __import__("json").loads((tmp_path / "out" / "megatron_lm_switch.json").read_text())
    assert out["muon:dmuon"]["max_abs_loss_gap"] == pytest.approx(1e-4) and out["muon:dmuon"]["iterations_compared"] == 8
    assert out["dmuon:muon"]["max_abs_loss_gap"] == pytest.approx(0.0, abs=1e-12)
    assert "| muon:dmuon |" in (tmp_path / "out" / "megatron_lm_switch.md").read_text()


def test_switch_state_only_runs_no_resumed_training_and_reports_the_state_check(tmp_path, monkeypatch):
    """bench/megatron_lm_switch.py --state-only: per direction the first optimizer trains to
    --switch-at and saves, the other loads and saves again without a step; no resumed run; the
    tensor check's result is what decides the exit code."""
    calls = []

    def fake_run(name, args, megatron_lm, log_dir, label=None, more=()):
        calls.append((label, args.iters, getattr(args, "start", 0)))
        if "--save" in more:  # Megatron-LM writes the checkpoint it was asked for
            os.makedirs(os.path.join(more[more.index("--save") + 1], "iter_0000008"), exist_ok=True)
        return {"run": name, "iterations": [], "median_ms": 1.0}

    monkeypatch.setattr(switch, "run", fake_run)
    monkeypatch.setattr(switch.subprocess, "run", lambda *a, **k: None)
    monkeypatch.setattr(switch, "compare_saved", lambda a, b: {"max_abs_by_kind": {"exp_avg": 0.0}, "tensors_compared": {"exp_avg": 1}})
    assert switch.main(["--megatron-lm", str(tmp_path), "--iters", "16", "--switch-at", "8", "--state-only",
                        "--out", str(tmp_path / "out")]) == 0
    assert calls == [("muon_never_switched", 8, 0), ("muon_to_dmuon_load_only", 8, 8),
                     ("dmuon_never_switched", 8, 0), ("dmuon_to_muon_load_only", 8, 8)]
    table = (tmp_path / "out" / "megatron_lm_switch.md").read_text()
    assert "| muon:dmuon | (state check only) |" in table and "0.0e+00" in table
    monkeypatch.setattr(switch, "compare_saved", lambda a, b: (_ for _ in ()).throw(OSError("unreadable")))
    assert switch.main(["--megatron-lm", str(tmp_path), "--iters", "16", "--switch-at", "8", "--state-only"]) == 1


def test_band_pools_reference_pairs_over_seeds_and_trees(tmp_path):
    """bench/megatron_lm_band.py: the band is every pair of reference curves (Megatron's two NS
    precisions, DMuon's fp32 NS, Megatron's run on each tree), pooled over seeds and trees; a candidate
    is inside when its largest gap is at most the largest reference gap and its mean at most the widest
    reference mean; a one-seed file needs its seed; a later file replaces an earlier (tree, seed, run)."""
    import json

    def curve(spike_at=None, size=0.0):
        return [{"loss": 1.0 - 0.1 * i + (size if i == spike_at else 0.0)} for i in range(6)]

    def write(name, iterations, summary):
        path = tmp_path / name
        path.write_text(json.dumps({"summary": summary, "iterations": iterations}))
        return str(path)

    # tree A, seeds 1 and 2: Megatron's fp32 NS 0.001 off at seed 1, DMuon fp32 NS 0.003 off at seed 2
    a = write("a.json", {"muon_s1": curve(), "muon_fp32ns_s1": curve(2, 0.001), "dmuon_fp32ns_s1": curve(),
                         "dmuon_s1": curve(3, 0.002), "muon_s2": curve(), "muon_fp32ns_s2": curve(),
                         "dmuon_fp32ns_s2": curve(1, 0.003), "dmuon_s2": curve(1, 0.0025)}, {"seeds": [1, 2]})
    # tree B, one seed (1) recorded by compare.py itself; its muon is 0.0005 off tree A's
    b = write("b.json", {"muon": curve(4, 0.0005), "muon_fp32ns": curve(4, 0.0005), "dmuon": curve(3, 0.0025)},
              {"seed": 1})
    trees = {"A": band_tool.read_curves(a), "B": band_tool.read_curves(b)}
    band = band_tool.pooled_band(trees, ["dmuon"])
    refs = band["reference_pairs"]
    assert refs["muon_fp32ns vs muon"] == {"A 1": pytest.approx(0.001), "A 2": 0.0, "B 1": 0.0}
    assert refs["dmuon_fp32ns vs muon"] == {"A 1": 0.0, "A 2": pytest.approx(0.003)}
    assert refs["muon: B vs A"] == {"1": pytest.approx(0.0005)}
    assert band["reference_largest"] == pytest.approx(0.003)
    v = band["verdicts"]["dmuon"]
    # gaps 0.002 (A 1), 0.0025 (A 2), 0.0025 (B 1: its spike and muon's sit at different iterations)
    assert v["largest"] == pytest.approx(0.0025) and v["samples"] == 3
    assert v["within_per_seed_band"] == 0
    # mean 0.00233 exceeds the widest reference mean (dmuon_fp32ns vs muon_fp32ns: (0.001 + 0.003) / 2)
    assert band["reference_widest_mean"] == pytest.approx(0.002) and v["within_band"] is False
    # a re-run after a fix replaces the candidate's curves; then it is inside
    fixed = write("fixed.json", {"dmuon": curve(3, 0.001)}, {})
    trees["B"].update(band_tool.read_curves(fixed + "@1"))
    assert band_tool.pooled_band(trees, ["dmuon"])["verdicts"]["dmuon"]["within_band"] is True
    with pytest.raises(SystemExit, match="@SEED"):
        band_tool.read_curves(fixed)
    assert band_tool.main(["--tree", "A", a, "--tree", "B", b, fixed + "@1", "--candidates", "dmuon",
                           "--out", str(tmp_path / "out")]) == 0
    assert "within the band" in (tmp_path / "out" / "band.md").read_text()
