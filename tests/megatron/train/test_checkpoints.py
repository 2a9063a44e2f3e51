"""Bad input the main job meets while it runs (docs/bad_input.md rows 32-44): checkpoints of the
AdamW baseline, resumes under another global batch or another owner plan, a loaded iteration past
--train-iters, a tracker naming a lost iteration, two writers of one --save directory, runs that
stop learning, and a usage error under launch/run_main.sh. Each case is one real 2-rank run of
the main job (python -m megatron_dmuon.testing.cpu_train, gloo; tests/megatron/train/main_job.py); runs
that several tests read are shared (module fixtures here, session fixtures in conftest.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from megatron_dmuon.testing.usage_errors import main_job_refusal
from tests import ROOT
from tests.megatron.train.main_job import SMALL, job, losses, same_tensors, stop_at, summary, tensors


# ------------------------------------------------------------------------- the AdamW baseline
@pytest.fixture(scope="module")
def adam(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adam")
    full = job("--optimizer", "adam", "--train-iters", 8, "--save", tmp / "full", "--save-interval", 4)
    resumed = job("--optimizer", "adam", "--train-iters", 8, "--load", stop_at(tmp / "full", tmp / "resumed", 4),
                  "--save", tmp / "resumed")
    return tmp, full, resumed


def test_adam_baseline_resumes_bit_identically(adam):
    tmp, full, resumed = adam
    assert "loaded checkpoint" in resumed.stdout
    assert {k: v for k, v in losses(full).items() if k > 4} == losses(resumed)
    same_tensors(tensors(tmp / "full", 8), tensors(tmp / "resumed", 8))


def test_resume_under_another_global_batch_counts_consumed_samples(adam):
    tmp, _, _ = adam
    run = job("--optimizer", "adam", "--train-iters", 6, "--global-batch-size", 16,
              "--load", stop_at(tmp / "full", tmp / "gbs", 4), "--use-checkpoint-opt_param-scheduler")
    lines = [l for l in run.stdout.splitlines() if l.startswith(" iteration        5/")]
    assert "consumed samples:         48 |" in lines[0], lines  # 4 x 8 + 16 (not 5 x 16 = 80)
    assert summary(run)["consumed_samples"] == 64


def test_a_loaded_iteration_at_train_iters_trains_nothing_and_says_so(adam):
    tmp, _, _ = adam
    run = job("--optimizer", "adam", "--train-iters", 8, "--load", tmp / "full")
    assert "nothing to train (raise --train-iters to continue, with --override-opt_param-scheduler" in run.stdout
    s = summary(run)
    assert s["trained_iterations"] == 0 and s["iteration"] == 8 and s["val_loss"] is not None


def test_a_tracker_naming_a_lost_iteration_names_the_last_complete_one(adam, capsys, monkeypatch):
    """(the start-up checks in this process, as --parse-only runs them: main_job_refusal)"""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tmp, _, _ = adam
    broken = stop_at(tmp / "full", tmp / "lost", 8)
    shutil.rmtree(broken / "iter_0000008")
    err = main_job_refusal(["--optimizer", "adam", "--load", broken, "--parse-only"], capsys)  # exit 2, one error
    assert f"{broken / 'latest_checkpointed_iteration.txt'} names iteration 8, but" in err and "is missing" in err, err
    assert "the last complete checkpoint there is iteration 4: write 4 into" in err
    assert "Traceback" not in err, err


# ----------------------------------------------------------------- DMuon: another owner plan
def _parse(argv):
    """The job's start-up checks in this process (as launch/run_main.sh's --parse-only runs them)."""
    from megatron_dmuon.megatron.train.args import parse_args

    return parse_args([*SMALL, *map(str, argv)])


def test_a_checkpoint_of_another_model_is_refused_at_start_up(adam, capsys, monkeypatch):
    """Heads / query groups 4 / 2 saved, 2 / 1 asked: the same tensor shapes, another
    model. Refused by name by the start-up checks, which every rank runs before anything is built."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    root = adam[0] / "full"
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--optimizer", "adam", "--load", root, "--num-attention-heads", 2, "--num-query-groups", 1])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("error:") == 1, err
    assert ("was saved by another model (--num-attention-heads 4 --num-query-groups 2; this run: "
            "--num-attention-heads 2 --num-query-groups 1)") in err, err
    assert _parse(["--optimizer", "adam", "--load", root, "--train-iters", 8]).load == str(root)  # the same model


def test_load_of_one_checkpoint_or_a_broken_tracker_is_refused(adam, tmp_path, capsys, monkeypatch):
    """--load DIR/iter_0000008 (one checkpoint, not its parent) and a tracker that is a
    directory trained from scratch beside complete checkpoints; now both are refused, naming the fix."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one = adam[0] / "full" / "iter_0000008"
    with pytest.raises(SystemExit):
        _parse(["--optimizer", "adam", "--load", one])
    assert f"--load {one} is one checkpoint, not the directory that holds them: pass --load {one.parent}" in \
        capsys.readouterr().err
    broken = stop_at(adam[0] / "full", tmp_path / "broken", 8)
    os.remove(broken / "latest_checkpointed_iteration.txt")
    os.mkdir(broken / "latest_checkpointed_iteration.txt")
    with pytest.raises(SystemExit):
        _parse(["--optimizer", "adam", "--load", broken])
    assert "latest_checkpointed_iteration.txt is not a file" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["shard_cut", "dcp_metadata_cut", "metadata_json_garbage"])
def test_a_damaged_checkpoint_is_named_with_the_last_one_that_reads(adam, tmp_path, capsys, monkeypatch, damage):
    """A data file cut to 100 bytes, torch DCP's .metadata cut, metadata.json = 'garbage{'
    gave raw DCP/JSON errors (and 'Connection closed by peer' on the other rank); now the start-up checks
    name the checkpoint as damaged, say why, and name the last complete iteration that reads (4)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    root = stop_at(adam[0] / "full", tmp_path / "damaged", 8)
    last = root / "iter_0000008"
    if damage == "shard_cut":
        shard = next(f for f in os.listdir(last) if f.endswith(".distcp"))
        os.truncate(last / shard, 100)
    elif damage == "dcp_metadata_cut":
        os.truncate(last / ".metadata", 100)
    else:
        (last / "metadata.json").write_text("garbage{")
    with pytest.raises(SystemExit):
        _parse(["--optimizer", "adam", "--load", root, "--train-iters", 8])
    err = capsys.readouterr().err
    assert f"the checkpoint {last} is damaged: " in err, err
    assert {"shard_cut": "holds 100 bytes of", "dcp_metadata_cut": ".metadata does not read",
            "metadata_json_garbage": "its metadata.json does not read"}[damage] in err, err
    assert f"the last complete checkpoint that reads is iteration 4: write 4 into {root}" in err, err


def test_a_fresh_run_into_another_runs_save_directory_is_refused(adam, capsys, monkeypatch):
    """A run without --load saving where another run's checkpoints are would have moved the
    tracker back (a later --load resumes the wrong run); --load of the same directory continues it."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    root = adam[0] / "full"
    with pytest.raises(SystemExit):
        _parse(["--optimizer", "adam", "--save", root])
    assert f"--save {root} holds the checkpoints of another run (up to iteration 8)" in capsys.readouterr().err
    assert _parse(["--optimizer", "adam", "--save", root, "--load", root, "--train-iters", 8]).save == str(root)


def test_a_resume_under_another_schedule_needs_megatrons_flag(adam, capsys, monkeypatch):
    """A longer --train-iters after a run saved at its end kept the saved schedule (lr at
    its minimum) without a word; as Megatron-LM, a differing schedule now needs --override-opt_param-
    scheduler (this run's) or --use-checkpoint-opt_param-scheduler (the checkpoint's)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    root = adam[0] / "full"
    with pytest.raises(SystemExit):
        _parse(["--optimizer", "adam", "--load", root, "--train-iters", 12])
    err = capsys.readouterr().err
    assert "the checkpoint's lr/wd schedule differs from this run's (lr_decay_steps 64 -> 96" in err, err
    assert "--override-opt_param-scheduler" in err and "--use-checkpoint-opt_param-scheduler" in err
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        assert _parse(["--optimizer", "adam", "--load", root, "--train-iters", 12, flag]).train_iters == 12
    with pytest.raises(SystemExit):
        _parse(["--optimizer", "adam", "--load", root, "--override-opt_param-scheduler",
                "--use-checkpoint-opt_param-scheduler"])
    assert "ask for opposite schedules" in capsys.readouterr().err


def test_a_longer_resume_follows_the_schedule_its_flag_names(adam, tmp_path):
    """Resumed at 8 of a run that ended at 8, now 12 iterations: under --override-opt_param-scheduler the
    lr of iteration 9 is the new cosine's (above the minimum); under --use-checkpoint-opt_param-scheduler it
    stays at the saved schedule's end (its minimum); --no-load-optim loads the model only."""
    def lr_at(run, it):
        line = next(l for l in run.stdout.splitlines() if l.startswith(f" iteration {it:8d}/"))
        return float(line.split("learning rate: ")[1].split()[0])

    load = stop_at(adam[0] / "full", tmp_path / "again", 8)
    new = job("--optimizer", "adam", "--train-iters", 12, "--load", load, "--override-opt_param-scheduler")
    old = job("--optimizer", "adam", "--train-iters", 12, "--load", load, "--use-checkpoint-opt_param-scheduler")
    assert lr_at(new, 9) > 1.5 * lr_at(old, 9), (lr_at(new, 9), lr_at(old, 9))
    fresh = job("--train-iters", 12, "--load", load, "--no-load-optim")  # AdamW checkpoint, DMuon run: model only
    assert summary(fresh)["trained_iterations"] == 4


def test_resume_under_another_owner_plan_is_bit_identical(dmuon_run, tmp_path):
    """The grad norm (and so clipping) no longer depends on which rank owns what (float64 partial
    sums): a run resumed under --dmuon-balance round_robin ends equal to one that kept 'cost' (the
    shared DMuon run: --dmuon-balance cost is the default)."""
    root, full = dmuon_run
    resumed = job("--train-iters", 8, "--load", stop_at(root, tmp_path / "rr", 4), "--save",
                  tmp_path / "rr", "--dmuon-balance", "round_robin")
    assert {k: v for k, v in losses(full).items() if k > 4} == losses(resumed)
    same_tensors(tensors(root, 8), tensors(tmp_path / "rr", 8))


# --------------------------------------------------------------------------- runs that go wrong
def test_a_second_writer_of_a_save_directory_fails_at_start_up(tmp_path):
    from megatron_dmuon.megatron.train.checkpoints import SaveLock

    held = SaveLock(str(tmp_path / "ck"))
    assert held.acquire() is None
    run = job("--train-iters", 4, "--save", tmp_path / "ck", expect=1)
    assert run.returncode != 0 and run.stderr.count("is being written by another run") == 1
    assert f"pid {os.getpid()}" in run.stderr and not os.path.exists(tmp_path / "ck" / "iter_0000004")


def test_a_run_whose_updates_keep_failing_stops_with_an_error(tmp_path):
    """DMuon skips every step with non-finite gradients; K of them in a row end the run (exit 1)."""
    run = job("--train-iters", 30, "--lr", "1e30", "--clip-grad", 0, "--exit-after-skipped-iterations", 3,
              "--save", tmp_path / "ck", "--save-interval", 1, expect=1)
    assert run.stderr.count("3 consecutive iterations up to") == 1, run.stderr[-2000:]
    saved = [int(n[5:]) for n in os.listdir(tmp_path / "ck") if n.startswith("iter_")]
    assert saved and all(torch.isfinite(t).all() for t in tensors(tmp_path / "ck", max(saved)).values()
                         if t.is_floating_point())


def test_adam_parameters_that_turn_non_finite_stop_the_run_before_a_save(tmp_path):
    """Megatron's AdamW (bf16 without a scaler, or fp32) applies a step with NaN gradients: the job
    sees the non-finite loss, finds the parameters non-finite and stops; no checkpoint holds them."""
    run = job("--optimizer", "adam", "--train-iters", 30, "--lr", "1e30", "--clip-grad", 0, "--save", tmp_path / "ck",
              "--save-interval", 1, expect=1)
    assert "the parameters are not finite" in run.stderr or "made the parameters non-finite" in run.stderr, \
        run.stderr[-2000:]
    saved = sorted(int(n[5:]) for n in os.listdir(tmp_path / "ck") if n.startswith("iter_"))
    if saved:
        assert all(torch.isfinite(t).all() for t in tensors(tmp_path / "ck", saved[-1]).values() if t.is_floating_point())


def test_a_run_that_ends_on_skipped_steps_does_not_exit_0(tmp_path):
    """--lr 1e10 on a short run skips its last steps (non-finite gradients) below the
    --exit-after-skipped-iterations limit: the summary is still written, then the job says the run did
    not train to its end and exits 1."""
    run = job("--train-iters", 6, "--lr", "1e10", "--clip-grad", 0, "--timing-json", tmp_path / "t.json", expect=1)
    assert run.stderr.count("the run did not train to its end: at iteration 6, the last,") == 1, run.stderr[-2000:]
    doc = json.load(open(tmp_path / "t.json"))
    assert doc["summary"]["skipped_iterations"] >= 1 and len(doc["iterations"]) == 6


def test_an_unwritable_timing_json_fails_the_run_by_name():
    """--timing-json /dev/full raised OSError after training; now the summary line stays,
    then one error names the flag and the reason, and the run exits 1."""
    run = job("--train-iters", 3, "--timing-json", "/dev/full", expect=1)
    assert run.stderr.count("--timing-json /dev/full could not be written (No space left on device)") == 1, \
        run.stderr[-2000:]
    assert summary(run)["trained_iterations"] == 3 and "OSError" not in run.stderr  # (torchrun adds its own report)


def test_an_adam_checkpoint_under_dmuon_is_one_error_naming_no_load_optim(adam, capsys, monkeypatch):
    """The AdamW baseline's checkpoint under --optimizer dmuon was a traceback; now one error
    (the job exits 2; torchrun, as for any failed child, 1) whose advice, --no-load-optim, the job has
    (test_a_longer_resume_... runs it)."""
    run = job("--train-iters", 8, "--load", adam[0] / "full", "--use-checkpoint-opt_param-scheduler", expect=1)
    assert run.stderr.count("dmuon-train: error: --load") == 1 and "--no-load-optim" in run.stderr, run.stderr[-2000:]
    assert "raise CheckpointMismatchError" not in run.stderr
    # the same refusal at start-up, before the schedule's (the optimizer is the first thing that differs;
    # the start-up checks in this process, as --parse-only runs them)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = main_job_refusal([*SMALL, "--train-iters", "20", "--load", adam[0] / "full", "--parse-only"], capsys)
    assert "was written by --optimizer adam, with no Muon momenta to keep: load the model only (--no-load-optim)" \
        in err and "lr/wd schedule differs" not in err, err[-2000:]


def test_a_run_time_error_under_run_main_prints_one_block_and_exits_1():
    """Under launch/run_main.sh a run-time error (here: the run ends on skipped steps) printed
    torchrun's report of the failed children after the job's own error; now the job's error alone, exit 1."""
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "run_main.sh"), *SMALL, "--train-iters", "6",
                           "--lr", "1e10", "--clip-grad", "0"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("error:") == 1 and "the run did not train to its end" in proc.stderr, proc.stderr[-2000:]
    assert "ChildFailedError" not in proc.stderr + proc.stdout and "> summary " in proc.stdout


def test_a_usage_error_under_run_main_prints_once_and_exits_2():
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "run_main.sh"), "--num-layers", "0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("error:") == 1 and "--num-layers must be >= 1" in proc.stderr
    assert "ChildFailedError" not in proc.stderr + proc.stdout
