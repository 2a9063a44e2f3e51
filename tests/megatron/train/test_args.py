"""The main job's trainer (docs/bad_input.md): outputs that would overwrite inputs or files
the job did not write, the test share of --split read, an empty --data-path, an .idx shorter than its
.bin, --ffn-hidden-size fixed while --hidden-size changes, train data that depended on the DP size,
--no-load-optim dropping the consumed samples, DMuon flags ignored under --optimizer adam, an adam
--load of a DMuon checkpoint failing late, a --save the OS refuses, and flags without effect.

Start-up refusals run in this process (the checks every rank runs before anything is built); what
only a run shows uses two real runs of the main job, shared by a module fixture."""
from __future__ import annotations

import os

import numpy as np
import pytest

from megatron_dmuon.testing.usage_errors import as_one_process, main_job_refusal

from tests.megatron.train.main_job import SMALL, job, losses, stop_at, summary


def _parse(argv):
    from megatron_dmuon.megatron.train.args import parse_args

    return parse_args([str(a) for a in argv])


_refused = main_job_refusal


def _dataset(prefix, docs=4, value=None):
    """An indexed dataset of ``docs`` documents of 200 int32 tokens (document d: all ``d`` with ``value``
    'doc', else counting mod 50)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in range(docs):
        tokens = np.full(200, d, dtype=np.int32) if value == "doc" else np.arange(d, d + 200, dtype=np.int32) % 50
        builder.add_document(tokens, [200])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(autouse=True)
def _one_process(monkeypatch, tmp_path):
    as_one_process(monkeypatch, tmp_path)


# ------------------------------------------------------------------- 1. outputs against inputs
@pytest.mark.parametrize("case", ["timing_json_is_the_bin", "timing_json_is_the_idx", "profile_out_is_the_idx",
                                  "timing_json_links_to_the_bin", "plan_cache_is_the_bin", "timing_json_is_the_tracker",
                                  "timing_json_in_a_checkpoint", "timing_json_is_profile_out", "save_over_the_data",
                                  "save_inside_the_loaded_checkpoint", "timing_json_not_ours", "profile_out_not_ours"])
def test_no_output_overwrites_an_input_or_a_file_it_did_not_write(tmp_path, capsys, monkeypatch, case):
    """--timing-json naming the dataset's .bin overwrote the dataset (exit 0). Every file the run writes
    (--timing-json, --profile-out, DMuon's caches, --save's checkpoints) is checked against every file it
    reads and against each other at start-up; an existing --timing-json / --profile-out must be the job's."""
    data = _dataset(str(tmp_path / "corpus"))
    ck = tmp_path / "ck"
    (ck / "iter_0000002").mkdir(parents=True)
    (ck / "latest_checkpointed_iteration.txt").write_text("2")
    (tmp_path / "link.bin").symlink_to(data + ".bin")
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "trace.json").write_text('{"a": 1}')
    base = ["--data-path", data, "--vocab-size", 64]
    profile = ["--profile-optimizer-at", 1]
    argv, message = {
        "timing_json_is_the_bin": (base + ["--timing-json", data + ".bin"],
                                   f"--timing-json {data}.bin is the dataset {data}.bin that --data-path {data} reads"),
        "timing_json_is_the_idx": (base + ["--timing-json", data + ".idx"], f"is the dataset {data}.idx"),
        "profile_out_is_the_idx": (base + profile + ["--profile-out", data + ".idx"],
                                   f"--profile-out {data}.idx is the dataset {data}.idx"),
        "timing_json_links_to_the_bin": (base + ["--timing-json", tmp_path / "link.bin"], f"is the dataset {data}.bin"),
        "plan_cache_is_the_bin": (base, f"the DMuon owner plan cache $DMUON_PLAN_CACHE {data}.bin is the dataset"),
        "timing_json_is_the_tracker": (["--timing-json", ck / "latest_checkpointed_iteration.txt", "--save", ck,
                                        "--load", ck], "where --load reads checkpoints"),
        "timing_json_in_a_checkpoint": (["--timing-json", ck / "iter_0000004" / "t.json", "--save", ck, "--load", ck],
                                        f"lies in {ck / 'iter_0000004'}, where --load reads checkpoints"),
        "timing_json_is_profile_out": (profile + ["--timing-json", tmp_path / "t.json", "--profile-out",
                                                  tmp_path / "t.json"], "--timing-json and --profile-out name the same file"),
        "save_over_the_data": (["--data-path", tmp_path / "iter_0000001" / "c", "--vocab-size", 64, "--save", tmp_path],
                               f"--save {tmp_path} would write over {tmp_path / 'iter_0000001' / 'c'}.bin"),
        "save_inside_the_loaded_checkpoint": (["--load", ck, "--save", ck / "iter_0000002" / "more"],
                                              f"lies inside {ck}'s checkpoints, which --load reads"),
        "timing_json_not_ours": (["--timing-json", tmp_path / "notes.txt"],
                                 f"--timing-json {tmp_path / 'notes.txt'} exists and is not a timing JSON this job wrote"),
        "profile_out_not_ours": (profile + ["--profile-out", tmp_path / "trace.json"],
                                 "exists and is not a profile trace this job wrote"),
    }[case]
    if case == "plan_cache_is_the_bin":
        monkeypatch.setenv("DMUON_PLAN_CACHE", data + ".bin")
    if case == "save_over_the_data":
        (tmp_path / "iter_0000001").mkdir()
        _dataset(str(tmp_path / "iter_0000001" / "c"))
    before = open(data + ".bin", "rb").read()
    assert message in _refused(argv, capsys)
    assert open(data + ".bin", "rb").read() == before


def test_outputs_the_job_wrote_itself_may_be_written_again(tmp_path):
    """The other side of the check: a --timing-json / --profile-out of an earlier run (recognised by how
    the job writes them), an empty file, /dev/null, and a --timing-json beside the checkpoints pass."""
    import json

    from megatron_dmuon.megatron.train.summary import is_timing_json

    timing = tmp_path / "t.json"
    timing.write_text(json.dumps({"summary": {"optimizer": "dmuon"}, "iterations": []}, indent=1))
    assert is_timing_json(str(timing))
    trace = tmp_path / "trace.json"
    trace.write_text(' {\n    "schemaVersion": 1,\n    "deviceProperties": [],\n    "traceEvents": [\n  ]}')
    (tmp_path / "empty.json").write_text("")
    for argv in (["--timing-json", timing, "--profile-optimizer-at", 1, "--profile-out", trace],
                 ["--timing-json", tmp_path / "empty.json"], ["--timing-json", os.devnull],
                 ["--timing-json", tmp_path / "ck" / "t.json", "--save", tmp_path / "ck"]):
        (tmp_path / "ck").mkdir(exist_ok=True)
        _parse(argv)


# ------------------------------------------------------------------------------- 2. the split
def test_the_test_share_of_split_is_never_read(tmp_path, capsys):
    """--split 50,0,50 trained on the test share and 40,10,50 validated on it (the validation share was
    taken from the end). Now the shares follow in order, train, validation, test, and the test share is
    never read; a split without validation data is refused while validation runs."""
    from megatron_dmuon.megatron.train.data import split_bounds, token_source

    data = _dataset(str(tmp_path / "docs"), docs=10, value="doc")  # document d holds token d only
    seen = {}
    for split, extra in (("40,10,50", []), ("50,0,50", ["--eval-iters", 0]), ("95,5", [])):
        args = _parse(["--data-path", data, "--vocab-size", 64, "--split", split, "--seq-length", 32, *extra])
        source = token_source(args)
        seen[split] = (sorted(set(source.tokens.tolist())), sorted(set(source.valid_tokens.tolist())))
    assert seen["40,10,50"] == ([0, 1, 2, 3], [4])
    assert seen["50,0,50"] == ([0, 1, 2, 3, 4], [])
    assert seen["95,5"] == (list(range(9)), [9])  # (2 weights: validation is the last share, as before)
    # the default data, by bytes: the validation share ends where the test share starts
    assert split_bounds(1000, "40,10,50") == (range(0, 400), range(400, 500))
    assert split_bounds(1000, "95,5") == (range(0, 950), range(950, 1000))
    err = _refused(["--split", "50,0,50"], capsys)
    assert "--split 50,0,50 leaves 0 validation tokens" in err and "--eval-iters 0" in err, err
    err = _refused(["--data-path", data, "--vocab-size", 64, "--split", "50,0,50"], capsys)
    assert "--split 50,0,50 leaves 0 validation tokens" in err, err


# ----------------------------------------------------------------------- 3, 4. --data-path
def test_an_empty_data_path_and_an_index_shorter_than_its_bin_are_refused(tmp_path, capsys):
    """--data-path "" trained on the default data; an .idx listing fewer tokens than its .bin holds was
    accepted (the tokens past it never trained)."""
    err = _refused(["--data-path", ""], capsys)
    assert "--data-path '' names no path: give the prefix of a Megatron indexed dataset" in err, err
    data = _dataset(str(tmp_path / "corpus"))
    with open(data + ".bin", "ab") as f:
        f.write(np.arange(100, dtype=np.int32).tobytes())
    err = _refused(["--data-path", data, "--vocab-size", 64], capsys)
    assert f"{data}.idx and {data}.bin disagree: the index lists 4 documents in 3200 bytes, the .bin holds 3600; " \
           "rebuild the pair with Megatron-LM's preprocess tool" in err, err
    err = _refused(["--data-path", data + ".bin", "--vocab-size", 64], capsys)
    assert f"--data-path takes the prefix without the extension, --data-path {data}" in err, err


# ------------------------------------------------------------------------ 5. --ffn-hidden-size
def test_ffn_hidden_size_follows_hidden_size_as_in_megatron_lm(capsys):
    """--ffn-hidden-size stayed 352 whatever --hidden-size said; now the default model keeps its 352 and any
    other --hidden-size gets Megatron-LM's SwiGLU rule, int(4 x hidden x 2/3 / 64) x 64."""
    assert _parse([]).ffn_hidden_size == 352
    assert _parse(["--hidden-size", 256]).ffn_hidden_size == 640
    assert _parse(["--hidden-size", 512, "--num-attention-heads", 8]).ffn_hidden_size == 1344
    assert _parse(["--hidden-size", 256, "--ffn-hidden-size", 100]).ffn_hidden_size == 100  # given: kept
    err = _refused(["--hidden-size", 16], capsys)
    assert "--hidden-size 16 gives Megatron-LM's default --ffn-hidden-size int(4 x 16 x 2/3 / 64) x 64 = 0 (SwiGLU): " \
           "give --ffn-hidden-size" in err, err


# --------------------------------------------------------------------- 6. DP-independent data
def test_each_global_batch_is_the_same_samples_at_any_dp_size(tmp_path):
    """Train windows were seeded by (iteration, DP rank): DP 1 and DP 2 trained on other data. Now sample k
    is a function of (--seed, k); each global batch is the samples from the consumed count on, and each DP
    rank takes its slice, as Megatron's sampler does."""
    import torch

    args = _parse(["--data-path", _dataset(str(tmp_path / "c")), "--vocab-size", 64, "--seq-length", 16])
    from megatron_dmuon.megatron.train.data import token_source

    data = token_source(args)
    gbs, mbs = 16, 2
    whole = torch.cat(data.micro_batches(32, gbs, 1, 0, mbs))
    for dp in (2, 4, 8):
        parts = [data.micro_batches(32, gbs, dp, r, mbs) for r in range(dp)]
        assert all(len(p) == gbs // (mbs * dp) for p in parts)
        merged = sorted(map(tuple, torch.cat([m for p in parts for m in p]).tolist()))
        assert merged == sorted(map(tuple, whole.tolist())), dp
    assert torch.equal(whole, data.windows(32, gbs))  # another global batch continues the same sequence
    assert not torch.equal(whole, torch.cat(data.micro_batches(48, gbs, 1, 0, mbs)))


# --------------------------------------------------------------- 7, 8, 10 and flags without effect
def _optimizer_flags():
    """Every --muon-*/--dmuon-* option of the main job, with a value it accepts."""
    from megatron_dmuon.megatron.train import args as job_args

    parser = job_args.JobArgumentParser()
    from megatron_dmuon.megatron.flags import add_dmuon_args

    add_dmuon_args(parser, validate=False)
    parser.add_argument("--muon-no-nesterov", dest="muon_nesterov", action="store_false")
    out = []
    for action in parser._actions:
        for option in action.option_strings:
            if not option.startswith(("--muon-", "--dmuon-")):
                continue
            if action.nargs == 0:
                out.append([option])
            elif action.choices:
                out.append([option, str(list(action.choices)[0])])
            elif action.type in (int, float):
                out.append([option, "1" if action.default is None else str(action.default)])
            else:
                out.append([option, "x.json"])
    return out


def test_every_dmuon_flag_is_refused_under_adam(capsys):
    """--dmuon-balance, --dmuon-ns-check-interval, --muon-momentum (every --muon-*/--dmuon-* flag) were
    ignored under --optimizer adam with exit 0; each given one (abbreviated or --flag=value too) is refused
    by name. At their defaults, not given, nothing is said."""
    flags = _optimizer_flags()
    assert len(flags) >= 30, flags
    for flag in flags:
        err = _refused(["--optimizer", "adam", *flag], capsys)
        assert f"{flag[0]} has no effect under --optimizer adam; drop it or use --optimizer dmuon" in err, (flag, err)
    for argv, named in ((["--dmuon-bal", "cost"], "--dmuon-balance"), (["--muon-momentum=0.9"], "--muon-momentum")):
        assert f"{named} has no effect under --optimizer adam" in _refused(["--optimizer", "adam", *argv], capsys)
    assert _parse(["--optimizer", "adam"]).optimizer == "adam"


@pytest.mark.parametrize("argv,env,message", [
    (["--load", "LOAD", "--no-load-optim", "--use-checkpoint-opt_param-scheduler"], {},
     "--use-checkpoint-opt_param-scheduler has no effect with --no-load-optim: as in Megatron-LM, the lr schedule is "
     "loaded with the optimizer state"),
    (["--load", "LOAD", "--no-load-optim", "--override-opt_param-scheduler"], {},
     "--override-opt_param-scheduler has no effect with --no-load-optim"),
    (["--no-load-optim"], {}, "--no-load-optim has no effect without --load DIR"),
    (["--use-checkpoint-opt_param-scheduler"], {}, "--use-checkpoint-opt_param-scheduler has no effect without --load"),
    (["--save", "/proc/dmuon_save_check"], {}, "--save /proc/dmuon_save_check: cannot be created: /proc does not take "
                                               "a new directory"),
    (["--save", "/proc"], {}, "--save /proc: is not writable"),
    (["--timing-json", "/proc/t.json"], {}, "--timing-json /proc/t.json: its folder /proc does not take a new file"),
    (["--save", ""], {}, "--save '' names no path: give a path, or leave --save out"),
    (["--timing-json", ""], {}, "--timing-json '' names no path"),
    (["--fail-rank", "0"], {}, "--fail-rank has no effect without --fail-at-iteration ITER"),
    (["--fail-at-iteration", "2", "--fail-rank", "2"], {"WORLD_SIZE": "2"},
     "--fail-rank must be a global rank in [0, 2) or -1 for the last (got 2)"),
    (["--eval-interval", "5", "--eval-iters", "0"], {}, "--eval-interval has no effect with --eval-iters 0"),
    (["--fp8-recipe", "tensorwise"], {}, "--fp8-recipe tensorwise has no effect without --fp8-format"),
    (["--decoupled-min-lr", "1e-5"], {}, "--decoupled-min-lr has no effect without --decoupled-lr"),
    (["--dmuon-mode", "gather_then_compute", "--overlap-param-gather"], {},
     "--overlap-param-gather has no effect under --dmuon-mode gather_then_compute"),
    (["--dmuon-plan-budget", "30"], {}, "--dmuon-plan-budget has no effect without --dmuon-balance milp"),
    (["--dmuon-normuon-beta2", "0.9"], {}, "--dmuon-normuon-beta2 has no effect under --dmuon-update muon"),
    (["--dmuon-update", "normuon", "--dmuon-fraction-lr", "inverse_sqrt"], {},
     "--dmuon-fraction-lr has no effect under --dmuon-update normuon"),
    (["--dmuon-ns-check-interval", "0", "--dmuon-ns-check-bound", "2"], {},
     "--dmuon-ns-check-bound has no effect with --dmuon-ns-check-interval 0"),
    (["--eval-iters", "100000000"], {}, "--eval-iters 100000000 x --global-batch-size 16 validation windows"),
    ([], {"WORLD_SIZE": "two"}, "the environment variable WORLD_SIZE='two' must be an integer >= 1"),
    ([], {"WORLD_SIZE": "2", "RANK": "2"}, "the environment variable RANK='2' must be an integer [0, 2)"),
    ([], {"WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "the environment variable LOCAL_RANK='-1' must be an integer [0, 2)"),
    ([], {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be an integer [1, 65536)"),
], ids=["no_load_optim_use_checkpoint_scheduler", "no_load_optim_override_scheduler", "no_load_optim_without_load",
        "scheduler_flag_without_load", "save_in_proc", "save_is_proc", "timing_json_in_proc", "save_empty",
        "timing_json_empty", "fail_rank_alone", "fail_rank_out_of_range", "eval_interval_without_validation",
        "fp8_recipe_without_fp8", "decoupled_min_lr_alone", "overlap_param_gather_in_all_reduce_baseline",
        "plan_budget_without_milp", "normuon_beta2_under_muon", "fraction_lr_without_dion3", "check_bound_check_off",
        "eval_iters_beyond_memory",
        "world_size_not_a_number", "rank_out_of_range", "local_rank_negative", "master_port_out_of_range"])
def test_flags_and_environment_the_run_would_ignore_or_misread_are_refused(tmp_path, capsys, monkeypatch, argv, env,
                                                                         message):
    """--no-load-optim --use-checkpoint-opt_param-scheduler ignored the schedule flag (Megatron-LM loads the
    schedule with the optimizer state); --save /sys/kernel/x passed the start-up check (os.access says yes to
    root) and failed at the first save on every rank: the check now writes there. Flags that would have no
    effect, and torchrun's variables out of range, are refused by name."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [str(tmp_path / "load") if a == "LOAD" else a for a in argv]
    err = _refused(argv, capsys)
    assert message in err, err
    if env:
        return
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: rank 0 alone prints it
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        _parse(argv)
    assert capsys.readouterr().err == ""


# -------------------------------------------------------------- what only a run shows (shared)
@pytest.fixture(scope="module")
def runs(dmuon_run, tmp_path_factory):
    """Two runs: the shared DMuon run at DP 2 (saving at iterations 4 and 8); --optimizer adam --no-load-optim
    resuming its checkpoint of iteration 4 on one rank (DP 1)."""
    root, dp2 = dmuon_run
    tmp = tmp_path_factory.mktemp("runs")
    model_only_dp1 = job("--optimizer", "adam", "--train-iters", 8, "--load", stop_at(root, tmp / "at4", 4),
                         "--no-load-optim", nproc=1)
    return root, dp2, model_only_dp1


def test_a_model_only_resume_at_another_dp_size_continues_the_same_samples(runs):
    """Two bugs, one run. (6) Train windows were seeded by DP rank: the same seed and global batch gave
    other losses at 1 rank than at 2, and a resume at another DP size trained on other data. (7)
    --no-load-optim (here: --optimizer adam loading a DMuon checkpoint) restarted the consumed samples at
    0. Now, as in Megatron-LM, the iteration and the consumed samples continue (the optimizer state and the
    lr schedule start fresh), and global batch k is the same samples at any DP size: iteration 5 on one rank,
    resumed from the 2-rank run's checkpoint of iteration 4, has that run's iteration-5 loss (the loss is
    taken before the step: the same params and the same batch give it, to fp32 rounding)."""
    _, dp2, resumed = runs
    line = next(l for l in resumed.stdout.splitlines() if l.startswith(" iteration        5/"))
    assert "consumed samples:         40 |" in line, line
    assert float(losses(resumed)[5]) == pytest.approx(float(losses(dp2)[5]), rel=1e-6), (losses(resumed), losses(dp2))
    s = summary(resumed)
    assert (s["dp"], s["consumed_samples"], s["trained_iterations"]) == (1, 64, 4), s
    assert "at iteration 4, 32 consumed samples (model only: --no-load-optim" in resumed.stdout, resumed.stdout


def test_adam_loading_a_dmuon_checkpoint_is_refused_at_start_up_naming_no_load_optim(runs, capsys):
    """--optimizer adam --load <a DMuon checkpoint> ended after the model was built with a 757-character list
    of parameters and no word of --no-load-optim; now one line at start-up names the optimizer that saved it."""
    root = runs[0]
    # (--lr of the DMuon run: the schedules agree, so before, nothing at start-up stopped it)
    err = _refused([*SMALL, "--optimizer", "adam", "--train-iters", 8, "--lr", 3e-3, "--load", root], capsys)
    assert (f"--load {root}: {root / 'iter_0000008'} was written by --optimizer dmuon, whose Muon momenta "
            "--optimizer adam cannot continue") in err, err
    assert "load the model only (--no-load-optim)" in err and len(err.splitlines()[-1]) < 400, err
