"""Bad input fails at start-up with an error that names the problem, before any state changes; each case
is a row of docs/bad_input.md: the optimizer config, the main job's flags and data files, the tools' flags.
The checkpoint record's refusals are in tests/megatron/checkpoint/test_optimizer_state.py, the autotune
cache's in tests/kernels/test_autotune.py; the multi-process rows in tests/megatron/checkpoint/test_job.py,
tests/megatron/test_step_guards.py and tests/megatron/train/test_restarts.py."""
import os
from types import SimpleNamespace

import numpy as np
import pytest
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from megatron_dmuon.megatron.optimizer import DMuonConfig, check_dmuon_config
from megatron_dmuon.planning.owner_layout import ParamItem, plan_owner_layout

from tests import ROOT

DIST = DistributedDataParallelConfig(use_distributed_optimizer=True)


def _opt(**kw):
    return OptimizerConfig(**{"optimizer": "adam", "lr": 1e-3, "use_distributed_optimizer": True, **kw})


# ------------------------------------------------------------------------------ optimizer config
@pytest.mark.parametrize("kw,match", [
    (dict(decoupled_weight_decay=False), "decoupled weight decay"),
    (dict(optimizer="sgd"), "optimizer='sgd'"),
    (dict(optimizer="muon", muon_scalar_optimizer="lion"), "muon-scalar-optimizer lion"),
], ids=["coupled_weight_decay", "other_optimizer", "lion_scalar_optimizer"])
def test_unsupported_optimizer_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        check_dmuon_config(_opt(**kw), DIST, DMuonConfig())


def test_zero_size_param_is_refused_by_the_planner():
    with pytest.raises(ValueError, match="numel 0"):
        plan_owner_layout([ParamItem("w", 64, True, 1.0), ParamItem("empty", 0, False)], 2)


# ------------------------------------------------------------------------------- main job flags
def _job_args():
    from megatron_dmuon.megatron.train import args

    return args


def _dataset(prefix, truncate=False):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in range(4):
        builder.add_document(np.arange(d, d + 200, dtype=np.int32) % 50, [200])
    builder.finalize(prefix + ".idx")
    if truncate:
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(os.path.getsize(prefix + ".bin") // 2)


@pytest.mark.parametrize("argv,message", [
    (["--num-layers", "0"], "--num-layers must be >= 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--hidden-size", "130"], "--hidden-size 130 must be divisible by --num-attention-heads 4"),
    (["--num-query-groups", "3"], "--num-attention-heads 4 must be divisible by --num-query-groups 3"),
    (["--lr", "0"], "--lr 0.0 must be a finite number in (0, inf)"),
    (["--clip-grad", "-1"], "--clip-grad -1.0 must be a finite number in [0, inf); 0 turns clipping off"),
    (["--global-batch-size", "6"], "--global-batch-size 6 must be a multiple of --micro-batch-size x DP"),
    (["--save-interval", "5"], "--save-interval needs --save DIR"),
    (["--save", "ck", "--dmuon-mode", "gather_then_compute"], "--save/--load support --dmuon-mode dmuon"),
    (["--fail-at-iteration", "0"], "--fail-at-iteration must be in"),
    (["--profile-iterations", "2"], "--profile-iterations 2 needs --profile-optimizer-at ITER"),
    (["--train-iters", "8", "--profile-optimizer-at", "8", "--profile-iterations", "2"], "ITER + N - 1 <= --train-iters"),
    (["--data-path", "PREFIX"], "PREFIX.bin does not exist"),
    (["--data-path", "TRUNCATED", "--vocab-size", "64"], "TRUNCATED.bin is truncated"),
    (["--dmuon-balance", "milp", "--dmuon-plan-budget", "0"], "--dmuon-plan-budget 0.0 must be a finite number in (0"),
    # values that would silently ruin or disable a run
    (["--muon-extra-scale-factor", "0"], "--muon-extra-scale-factor 0.0 must be a finite number in (0, inf); 0 would freeze"),
    (["--muon-extra-scale-factor", "-1"], "--muon-extra-scale-factor -1.0 must be a finite number in (0, inf)"),
    (["--muon-extra-scale-factor", "nan"], "--muon-extra-scale-factor nan must be a finite number"),
    (["--lr", "inf"], "--lr inf must be a finite number in (0, inf)"),
    (["--optimizer", "adam", "--lr", "nan"], "--lr nan must be a finite number"),
    (["--clip-grad", "nan"], "--clip-grad nan must be a finite number in [0, inf); 0 turns clipping off"),
    (["--weight-decay", "nan"], "--weight-decay nan must be a finite number in [0, inf)"),
    (["--weight-decay", "-1"], "--weight-decay -1.0 must be a finite number in [0, inf); 0 turns weight decay off"),
    (["--min-lr", "nan"], "--min-lr nan must be a finite number"),
    (["--muon-momentum", "1.5"], "--muon-momentum 1.5 must be a finite number in [0, 1)"),
    (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps 0 must be an integer >= 1"),
    (["--dmuon-ns-check-bound", "-2"], "--dmuon-ns-check-bound -2.0 must be a finite number in (0, inf)"),
    (["--dmuon-ns-check-interval", "-1"], "--dmuon-ns-check-interval -1 must be an integer >= 0"),
    (["--exit-after-skipped-iterations", "-1"], "--exit-after-skipped-iterations must be >= 0"),
    # what needs the data or the file system, before the model is built
    (["--data-path", "BIGVOCAB", "--vocab-size", "32"], "--vocab-size 32 is smaller than the dataset's max token id 49"),
    (["--data-path", "BIGVOCAB", "--vocab-size", "64", "--seq-length", "1000"], "the train split has"),
    (["--seq-length", "100000"], "needs at least"),
    (["--timing-json", "NOFOLDER/t.json"], "its folder"),
    (["--timing-json", "TMP"], "is a directory"),
    (["--save", "AFILE/ck"], "cannot be created"),
    (["--save", "AFILE"], "exists and is not a directory"),
    # the parallel layout's own error first
    (["--tensor-model-parallel-size", "3"], "the world size 2 must be a multiple of --tensor-model-parallel-size"),
], ids=["layers0", "mbs0", "hidden_heads", "heads_groups", "lr0", "clip_negative", "batch_split", "interval_no_save",
        "save_baseline_mode", "fail_iteration", "profile_iterations_alone", "profile_iterations_past_end", "missing_bin", "truncated_bin", "plan_budget0",
        "extra_scale0", "extra_scale_negative", "extra_scale_nan", "lr_inf", "adam_lr_nan", "clip_nan", "wd_nan",
        "wd_negative", "min_lr_nan", "momentum_1_5", "ns_steps0", "check_bound_negative", "check_interval_negative",
        "skip_limit_negative", "vocab_below_max_id", "data_shorter_than_seq", "absurd_seq_length",
        "timing_json_folder", "timing_json_dir", "save_uncreatable", "save_file", "tp3_on_2_ranks"])
def test_main_job_validates_its_arguments(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("WORLD_SIZE", "2") if "3" in argv else monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "afile").write_text("x")
    if "BIGVOCAB" in argv:
        prefix = str(tmp_path / "corpus")
        _dataset(prefix)  # token ids 0..49
        argv = [prefix if a == "BIGVOCAB" else a for a in argv]
    argv = [a.replace("NOFOLDER", str(tmp_path / "nofolder")).replace("AFILE", str(tmp_path / "afile"))
            if isinstance(a, str) else a for a in argv]
    argv = [str(tmp_path) if a == "TMP" else a for a in argv]
    if "TRUNCATED" in argv:
        prefix = str(tmp_path / "corpus")
        _dataset(prefix, truncate=True)
        argv = [prefix if a == "TRUNCATED" else a for a in argv]
        message = message.replace("TRUNCATED", prefix)
    argv = [str(tmp_path / "none") if a == "PREFIX" else a for a in argv]
    message = message.replace("PREFIX", str(tmp_path / "none"))
    with pytest.raises(SystemExit) as exit_info:
        _job_args().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("error:") == 1 and not err.rstrip().endswith(";")


def _odd_dataset(prefix, kind):
    """An indexed dataset of float32 'tokens' or with a negative token id."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = np.float32 if kind == "float" else np.int32
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in range(4):
        doc = (np.arange(d, d + 200) % 50).astype(dtype)
        if kind == "negative" and d == 3:
            doc[7] = -1
        builder.add_document(doc, [200])
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("argv,message", [
    (["--decoupled-lr", "-1"], "--decoupled-lr -1.0 must be a finite number in (0, inf)"),
    (["--decoupled-lr", "nan"], "--decoupled-lr nan must be a finite number in (0, inf)"),
    (["--optimizer", "adam", "--decoupled-lr", "nan"], "--decoupled-lr nan must be a finite number in (0, inf)"),
    (["--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-3"],
     "--decoupled-min-lr (0.001) must not exceed --decoupled-lr (0.0001)"),
    (["--split", "inf,inf"], "--split 'inf,inf': give 2 or 3 finite non-negative weights"),
    (["--split", "1,inf"], "--split '1,inf': give 2 or 3 finite non-negative weights"),
    (["--seed", "18446744073709551617"], "--seed must be in [0, 2^32) (got 18446744073709551617)"),
    (["--seed", "-1"], "--seed must be in [0, 2^32) (got -1)"),
    (["--vocab-size", "257", "--tensor-model-parallel-size", "2"],
     "--vocab-size 257 must be divisible by --tensor-model-parallel-size 2"),
    (["--hidden-size", "4", "--num-attention-heads", "4"], "the head dimension, must be even"),
    (["--data-path", "FLOAT", "--vocab-size", "64"], "says its tokens are float32, not integer token ids"),
    (["--data-path", "NEGATIVE", "--vocab-size", "64"], "the dataset holds a negative token id (-1)"),
    (["--split", "1,10000000"], "the train split has "),
    (["--save", "LOCKDIR"], "its lock file .dmuon_save.lock is a directory: remove it"),
    (["--save", "ITERFILE"], "iter_0000004 is a file where a checkpoint directory would be written"),
    (["--hidden-size", "8192", "--num-layers", "4"], "needs at least 33.0 GiB per rank for its params, grads and "
                                                     "optimizer state, more than the 4.0 GiB this rank has"),
    (["--dmuon-overlap-step", "on"], "exist only with --overlap-param-gather: add --overlap-param-gather"),
    (["--dmuon-overlap-step", "on", "--overlap-param-gather", "--dmuon-mode", "gather_then_compute"],
     "--dmuon-overlap-step on applies to --dmuon-mode dmuon (got gather_then_compute)"),
    (["--dmuon-overlap-step", "sync", "--dmuon-update", "normuon"], "--dmuon-overlap-step sync runs the Muon rule only"),
    (["--dmuon-overlap-step", "on", "--overlap-param-gather", "--vocab-size", "256", "--tensor-model-parallel-size", "2"],
     "--dmuon-overlap-step on is not implemented with tensor parallelism"),
    (["--dmuon-overlap-step", "backward", "--overlap-param-gather", "--clip-grad", "0"],
     "happens only with --overlap-grad-reduce: add it"),
], ids=["decoupled_lr_negative", "decoupled_lr_nan", "adam_decoupled_lr_nan", "decoupled_min_above",
        "split_inf_inf", "split_1_inf", "seed_overflow", "seed_negative", "vocab_tp", "head_dim_1", "float_tokens",
        "negative_token", "split_train_too_short", "lock_is_a_directory", "iter_file_in_save", "model_state_beyond_memory",
        "overlap_step_without_param_gather_hooks", "overlap_step_baseline_mode", "overlap_step_row_rule",
        "overlap_step_tp", "backward_start_without_grad_reduce_hooks"])
def test_inputs_once_accepted_silently_or_failing_late_are_refused_at_start_up(tmp_path, capsys, monkeypatch, argv, message):
    """Inputs that were accepted silently or failed late (in the model, the forward, or the
    CPU shim) are refused by the start-up checks, before any process group, naming the flag."""
    monkeypatch.setenv("WORLD_SIZE", "2") if "--tensor-model-parallel-size" in argv else \
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    for tag, kind in (("FLOAT", "float"), ("NEGATIVE", "negative")):
        if tag in argv:
            prefix = str(tmp_path / "corpus")
            _odd_dataset(prefix, kind)
            argv = [prefix if a == tag else a for a in argv]
    (tmp_path / "LOCKDIR" / ".dmuon_save.lock").mkdir(parents=True)
    (tmp_path / "ITERFILE").mkdir()
    (tmp_path / "ITERFILE" / "iter_0000004").write_text("x")
    argv = [str(tmp_path / a) if a in ("LOCKDIR", "ITERFILE") else a for a in argv]
    from megatron_dmuon.megatron.train import checks

    monkeypatch.setattr(checks, "_available_bytes", lambda: 4 * 2**30)  # the bound's test machine
    with pytest.raises(SystemExit) as exit_info:
        _job_args().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("error:") == 1


def test_a_damaged_index_is_named_without_a_stray_report(tmp_path, capsys, monkeypatch):
    """A damaged .idx gave its clear error, then "Exception ignored in IndexedDataset.__del__"."""
    import gc
    import sys

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prefix = str(tmp_path / "corpus")
    _dataset(prefix)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(12)
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(u))
    with pytest.raises(SystemExit):
        _job_args().parse_args(["--data-path", prefix, "--vocab-size", "64"])
    gc.collect()
    assert f"cannot read {prefix}.idx" in capsys.readouterr().err
    assert ignored == [], [str(u.exc_value) for u in ignored]


def test_usage_errors_print_on_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        _job_args().parse_args(["--num-layers", "0"])
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


def test_main_job_accepts_a_complete_dataset(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prefix = str(tmp_path / "corpus")
    _dataset(prefix)
    args = _job_args().parse_args(["--data-path", prefix, "--vocab-size", "64", "--save", str(tmp_path / "ck"),
                                  "--save-interval", "2", "--load", str(tmp_path / "ck")])
    assert args.save_interval == 2


@pytest.mark.parametrize("cli,argv,message", [
    ("verify", ["--resume-at", "0"], "--resume-at must be in [1, --steps)"),
    ("verify", ["--steps", "4", "--resume-at", "4"], "--resume-at must be in [1, --steps)"),
    ("verify", ["--resume-dp", "1"], "--resume-dp / --resume-tp / --resume-vpp need --resume-at K"),
    ("verify", ["--vpp", "2"], "--vpp 2 needs --pp > 1"),
    ("verify", ["--pp", "2", "--vpp", "0"], "--vpp must be >= 1 (got 0)"),
    ("verify", ["--pp", "2", "--vpp", "2", "--resume-at", "2", "--resume-vpp", "0"], "--resume-vpp must be >= 1"),
    ("verify", ["--pp", "2", "--vpp", "2", "--grad-accum", "1"], "--grad-accum 1 gives 1 micro-batch(es) per rank, fewer than --pp 2"),
    ("verify", ["--pp", "2", "--vpp", "2", "--dp", "2", "--resume-at", "2", "--resume-dp", "4", "--resume-vpp", "2"],
     "gives 1 micro-batch(es) per rank, fewer than --pp 2"),
    ("verify", ["--pp", "2", "--vpp", "2", "--resume-at", "2", "--resume-vpp", "1", "--resume-format", "torch"],
     "--resume-format torch keeps one file per TP/PP rank"),
    ("verify", ["--dp", "2", "--resume-at", "2", "--resume-dp", "3"], "--resume-dp 3 must divide the global batch"),
    ("check", ["--dp", "2", "--corrupt-rank", "5"], "--corrupt-rank must be a rank in [0, 2)"),
    ("verify", ["--dp", "0"], "--dp must be >= 1 (got 0)"),
    ("verify", ["--tol", "-1"], "--tol must be a finite number > 0"),
    ("verify", ["--tp", "3"], "--tp 3 must divide the checked GPT's attention heads (4)"),
    ("verify", ["--ep", "3"], "--ep 3 must divide the checked MoE GPT's 4 experts"),
])
def test_cli_flags_are_validated(capsys, cli, argv, message):
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"megatron_dmuon.testing.{cli}_cli").main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err
    assert "--steps 0 would check nothing" not in err or "--steps" in argv


@pytest.mark.parametrize("argv,message", [
    (["--preset", "qwen2.5-7b", "--dp", "0"], "--dp must be >= 1 (got 0)"),
    (["--preset", "qwen2.5-7b", "--dp", "8", "--tp", "3"], "--tp 3 must divide the model's attention heads (28)"),
    (["--preset", "qwen2.5-7b", "--dp", "8", "--stage", "2"], "--stage 2 must be a pipeline stage in [0, --pp) = [0, 1)"),
    (["--preset", "qwen2.5-7b", "--dp", "8", "--time-limit", "nan"], "--time-limit must be a finite number"),
    # raw tracebacks before
    (["--preset", "tiny", "--dp", "2", "--profile", "LIST"], "--profile LIST: not a CostTable, a one-entry profile"),
    (["--preset", "tiny", "--dp", "2", "--cluster", "nosuch"], "--cluster nosuch: cluster 'nosuch' not in the cluster"),
    (["--preset", "tiny", "--dp", "2", "--config", "/dev/null"], "--config /dev/null is not a regular file"),
    (["--preset", "tiny", "--dp", "2", "--config", "LIST"], "--config LIST: not a readable cluster config"),
])
def test_dmuon_plan_validates_its_arguments(capsys, tmp_path, argv, message):
    from megatron_dmuon.planning import plan_cli

    (tmp_path / "list.json").write_text("[1, 2]")
    argv = [str(tmp_path / "list.json") if a == "LIST" else a for a in argv]
    message = message.replace("LIST", str(tmp_path / "list.json"))

    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["directory", "uncreatable"])
def test_a_cache_path_that_cannot_be_written_is_named_and_leaves_nothing(tmp_path, monkeypatch, kind):
    from megatron_dmuon.megatron.flags import check_cache_paths
    from megatron_dmuon.planning.caches import PlanCache

    (tmp_path / "afile").write_text("x")
    target = tmp_path / "plans" if kind == "directory" else tmp_path / "afile" / "plans.json"
    if kind == "directory":
        target.mkdir()
    monkeypatch.setenv("DMUON_PLAN_CACHE", str(target))
    with pytest.raises(ValueError, match=r"the DMuon owner plan cache .* point \$DMUON_PLAN_CACHE at a writable file"):
        check_cache_paths(SimpleNamespace())
    with pytest.raises(ValueError, match="owner plan cache"):  # a direct write says the same, and leaves no file
        PlanCache(target).put("k", {"a": 1})
    assert sorted(os.listdir(tmp_path)) == (["afile", "plans"] if kind == "directory" else ["afile"])
    if kind == "directory":
        assert os.listdir(target) == []


def test_run_main_keeps_dmuon_warnings_visible():
    """launch/run_main.sh silences Megatron's notices (UserWarning...) but not DMuon's RuntimeWarnings
    (a corrupt plan cache is re-planned with a warning the user sees)."""
    import re
    import subprocess
    import sys

    text = open(os.path.join(ROOT, "launch", "run_main.sh")).read()
    value = re.search(r'PYTHONWARNINGS="\$\{PYTHONWARNINGS:-([^}]*)\}"', text).group(1)
    code = "import warnings; warnings.warn('seen', RuntimeWarning); warnings.warn('hidden', UserWarning)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONWARNINGS=value))
    assert "seen" in proc.stderr and "hidden" not in proc.stderr


def test_every_row_of_the_bad_input_table_names_existing_tests():
    import re

    text = open(os.path.join(ROOT, "docs", "bad_input.md")).read()
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) >= 15
    for row in rows:
        test_cell = row.rstrip(" |").rsplit("|", 1)[1]
        current_file = None
        refs = re.findall(r"`(?:((?:\w+/)*test_\w+\.py))?::(test_\w+)", test_cell)
        assert refs, row
        for file, name in refs:
            current_file = file or current_file
            source = open(os.path.join(ROOT, "tests", current_file)).read()
            assert f"def {name}(" in source, (current_file, name)


@pytest.mark.parametrize("failure,reason", [
    ("[enforce fail at inline_container.cc:603] . unexpected pos 4480 vs 4368",
     "no space left on device: the disk holding it is full"),
    ("[Errno 28] No space left on device", "no space left on device: the disk holding it is full"),
    ("some other failure", "RuntimeError: some other failure"),
])
def test_a_failed_save_names_the_directory_and_the_checkpoint_kept(tmp_path, capsys, monkeypatch, failure, reason):
    """--save on a full disk ended in torch's 'enforce fail ... unexpected pos', never 'disk
    full'; the job now names --save, the reason and the checkpoint that is still the latest, and exits 1."""
    import torch.distributed as dist

    from megatron_dmuon.megatron.checkpoint import job as checkpoint_io
    from megatron_dmuon.megatron.train import checkpoints

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")

    def failing_save(*a, **k):
        raise RuntimeError(failure)

    monkeypatch.setattr(checkpoint_io, "save_checkpoint", failing_save)
    monkeypatch.setattr(checkpoints, "model_config_of", lambda args: {})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        args = SimpleNamespace(save=str(tmp_path))
        sched = SimpleNamespace(state_dict=lambda: {})
        with pytest.raises(SystemExit) as exit_info:
            checkpoints.save(args, 8, None, None, sched, 0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert (f"--save {tmp_path}: writing the checkpoint of iteration 8 failed ({reason}); iteration 4 is still the "
            "latest complete checkpoint there (the tracker was not moved)") in err, err
