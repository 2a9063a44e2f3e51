"""The flags, files and tools (docs/bad_input.md): flags that named other NS coefficients or
that the chosen --dmuon-mode never reads ran something else without a word; a full disk at --save lost
"no space left" and the checkpoint kept in run_main.sh's cut line; an empty .bin was blamed on the .idx,
then a __del__ traceback; a HOME that cannot hold the default caches passed the start-up check and failed
after the model was built; a symlink in --save was followed into rmtree; `dmuon plan --rank-model
/dev/zero` read until the OOM killer; bench/'s CLIs ended in tracebacks, or with no input in an empty
table and exit 0. The processes' cases (signals, NPROC, the Bridge launcher) are in
tests/megatron/test_child_processes.py.

Start-up refusals run in this process (the checks every rank runs before anything is built)."""
from __future__ import annotations

import argparse
import logging
import os
import resource
import subprocess
import sys

import numpy as np
import pytest

from megatron_dmuon.testing.usage_errors import as_one_process, main_job_refusal

from tests import ROOT

BENCH = os.path.join(ROOT, "bench")
FILTER = os.path.join(ROOT, "launch", "after_job_error.py")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch, tmp_path):
    as_one_process(monkeypatch, tmp_path)


def _parse(argv):
    from megatron_dmuon.megatron.train.args import parse_args

    return parse_args([str(a) for a in argv])


_refused = main_job_refusal


# ---------------------------------------------------------------- two flags naming other coefficients
@pytest.mark.parametrize("argv,refused", [
    (["--muon-coefficient-type", "cans", "--dmuon-coefficients", "keller"], True),
    (["--muon-coefficient-type", "quintic", "--dmuon-coefficients", "keller"], True),  # (given at its default)
    (["--muon-coefficient-type", "aol", "--dmuon-coefficients", "adaptive"], True),
    (["--muon-coefficient-type", "simple", "--dmuon-coefficients", "keller"], False),  # the same sets
    (["--dmuon-coefficients", "keller"], False),
], ids=["cans_keller", "quintic_given_keller", "aol_adaptive", "simple_is_keller", "dmuon_flag_alone"])
def test_coefficient_flags_that_disagree_are_refused_by_name(argv, refused, capsys):
    """`--muon-coefficient-type cans --dmuon-coefficients keller` ran keller without a word."""
    if not refused:
        _parse(argv)
        return
    message = _refused(argv, capsys)
    assert message.startswith(f"--dmuon-coefficients {argv[3]} and --muon-coefficient-type {argv[1]} name different "
                              "Newton-Schulz coefficients at --muon-num-ns-steps 5") and "drop one of the two" in message


def test_coefficient_flags_that_disagree_are_refused_under_the_hook_and_bridge():
    """The same rule where only the parsed values are known (Megatron-LM's parser, Bridge's fields): a
    --muon-coefficient-type other than Megatron's default beside another --dmuon-coefficients."""
    from megatron_dmuon.megatron.config import DMuonConfig
    from megatron_dmuon.megatron.flags import add_dmuon_args

    parser = add_dmuon_args(argparse.ArgumentParser(), validate=False)
    with pytest.raises(ValueError, match="--dmuon-coefficients keller and --muon-coefficient-type cans"):
        DMuonConfig.from_args(parser.parse_args(["--muon-coefficient-type", "cans", "--dmuon-coefficients", "keller"]))
    assert DMuonConfig.from_args(parser.parse_args(["--dmuon-coefficients", "keller"])).muon.coefficients == "keller"


# ------------------------------------------------------------ flags the chosen mode does not read
@pytest.mark.parametrize("argv,flag", [
    (["--dmuon-mode", "megatron_layerwise", "--dmuon-ns-method", "gram"], "--dmuon-ns-method gram"),
    (["--dmuon-mode", "gather_then_compute", "--dmuon-balance", "milp", "--dmuon-plan-budget", "3"],
     "--dmuon-balance milp"),
    (["--dmuon-mode", "megatron_layerwise", "--dmuon-split-heads"], "--dmuon-split-heads"),
    (["--dmuon-mode", "gather_then_compute", "--dmuon-megabatch"], "--dmuon-megabatch"),
    (["--dmuon-mode", "megatron_layerwise", "--dmuon-ns-check-interval", "0"], "--dmuon-ns-check-interval 0"),
    (["--dmuon-mode", "megatron_layerwise", "--dmuon-momentum-dtype", "bf16"], "--dmuon-momentum-dtype bf16"),
])
def test_a_flag_the_mode_does_not_read_is_refused_at_parse_time(argv, flag, capsys):
    """`--dmuon-mode megatron_layerwise --dmuon-ns-method gram` ran Megatron's standard NS; `gather_then_compute
    --dmuon-balance milp --dmuon-plan-budget 3` planned nothing; `megatron_layerwise --dmuon-split-heads` passed
    --parse-only, then failed on every rank naming defaults never passed."""
    message = _refused(argv, capsys)
    mode = argv[1]
    assert message.startswith(f"{flag} has no effect under --dmuon-mode {mode} (") and \
        message.endswith("which does not read it): drop it, or use --dmuon-mode dmuon"), message


def test_every_dmuon_flag_a_baseline_does_not_read_is_refused():
    """Table-driven (modes.py MODE_TRAITS dmuon_flags): for each baseline mode, each --dmuon-* flag outside its
    table, set to a value other than its default, fails at parse time naming that flag; each flag in it is
    accepted where its own checks allow."""
    from megatron_dmuon.megatron.flags import add_dmuon_args, validate_dmuon_args
    from megatron_dmuon.megatron.modes import MODE_TRAITS

    parser = add_dmuon_args(argparse.ArgumentParser(), validate=False)
    actions = {a.dest: a for a in parser._actions if a.dest.startswith("dmuon_") and a.dest != "dmuon_mode"}
    other = {"dmuon_plan_budget": "3", "dmuon_ranks_per_node": "2", "dmuon_fraction": "0.5",
             "dmuon_normuon_beta2": "0.9", "dmuon_ns_check_interval": "0", "dmuon_ns_check_bound": "2.0",
             "dmuon_autotune_cache": os.path.join(os.environ["DMUON_AUTOTUNE_CACHE"] + ".other")}
    checked = 0
    for traits in MODE_TRAITS.values():
        if traits.dmuon_flags is None:
            continue
        for dest, action in actions.items():
            flag = action.option_strings[0]
            if action.nargs == 0:
                argv = [flag]
            else:
                anyway = dict(traits.runs_as).get(dest, action.default)  # (accepted: what the mode runs)
                argv = [flag, other.get(dest) or next(c for c in action.choices if c not in (action.default, anyway))]
            args = parser.parse_args(["--dmuon-mode", traits.name, *argv])
            args.optimizer, args.lr, args.min_lr = "dmuon", 1e-3, 1e-4
            if dest in traits.dmuon_flags:
                continue
            with pytest.raises(ValueError, match=flag):
                validate_dmuon_args(args)
            checked += 1
    assert checked >= 15, checked


def test_a_flag_naming_what_the_mode_runs_anyway_is_accepted():
    """Side-by-side runs pass every mode one set of flags: `--dmuon-ns-method standard` is what Megatron's own
    Muon runs (tests/megatron/train/test_job.py compares DMuon with it so)."""
    args = _parse(["--dmuon-mode", "megatron_layerwise", "--dmuon-ns-method", "standard", "--bf16"])
    assert args.dmuon_ns_method == "standard"


def test_bridge_options_a_mode_does_not_read_are_refused():
    """Bridge's path (dmuon_config_from_fields) refuses them as the flags do."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_dmuon.megatron.flags import dmuon_config_from_fields

    with pytest.raises(ValueError, match="--dmuon-balance milp has no effect under --dmuon-mode gather_then_compute"):
        dmuon_config_from_fields(OptimizerConfig(), mode="gather_then_compute", balance="milp")
    assert dmuon_config_from_fields(OptimizerConfig(), mode="gather_then_compute", ns_method="gram").mode == \
        "gather_then_compute"


def test_megatron_layerwise_names_only_what_megatrons_muon_lacks(capsys):
    """A rule Megatron's own Muon has no equivalent of fails at parse time, naming what was asked (it listed
    coefficients, NS dtype and both split flags, at the first step on every rank, before)."""
    message = _refused(["--dmuon-mode", "megatron_layerwise", "--dmuon-coefficients", "adaptive"], capsys)
    assert message == ("--dmuon-mode megatron_layerwise runs Megatron's own Muon, which has no equivalent of the "
                       "Newton-Schulz coefficients 'adaptive' at 5 steps (--dmuon-coefficients polar_express is "
                       "DMuon's own variant; Megatron's is --muon-coefficient-type polar_express): drop it, or use "
                       "--dmuon-mode dmuon"), message


# ------------------------------------------------------------------------------- --save, --data-path
@pytest.mark.parametrize("name", ["iter_0000002", "latest_checkpointed_iteration.txt", ".dmuon_save.lock"])
def test_a_symbolic_link_where_a_save_writes_is_refused_at_start_up(tmp_path, capsys, name):
    """`--save D` with D/iter_0000002 a symlink trained, then `OSError: Cannot call rmtree on a symbolic
    link` at the first save (the lock file and the tracker were opened through links too). Now refused at
    start-up naming the link; what it points at is untouched."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("not yours")
    target = theirs if name.startswith("iter_") else theirs / "keep.txt"
    save = tmp_path / "ckpt"
    save.mkdir()
    os.symlink(target, save / name)
    message = _refused(["--save", save, "--save-interval", "2", "--train-iters", "8"], capsys)
    assert message == (f"--save {save}: {name} is a symbolic link (to {target}) where the job writes its own file: "
                       "remove the link, or save elsewhere"), message
    assert (theirs / "keep.txt").read_text() == "not yours"


def _dataset(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in range(4):
        builder.add_document(np.arange(d, d + 200, dtype=np.int32) % 50, [200])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("damage", ["empty_bin", "empty_idx", "fifo_bin"])
def test_an_empty_or_unreadable_data_file_is_named_without_a_stray_report(tmp_path, capsys, monkeypatch, damage):
    """`--data-path` naming a 0-byte .bin: the message named the .idx, then `Exception ignored in
    _MMapBinReader.__del__`. Now the file at fault, once; a FIFO is named as such (never opened)."""
    import gc

    prefix = _dataset(str(tmp_path / "tok"))
    ext = ".idx" if damage == "empty_idx" else ".bin"
    os.unlink(prefix + ext)
    if damage == "fifo_bin":
        os.mkfifo(prefix + ext)
    else:
        open(prefix + ext, "w").close()
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(u))
    message = _refused(["--data-path", prefix, "--vocab-size", "64"], capsys)
    gc.collect()
    assert ignored == [], [str(u.exc_value) for u in ignored]
    if damage == "fifo_bin":
        assert message == f"--data-path {prefix}: {prefix}.bin is not a regular file (a device, FIFO or socket): " \
                          "give a file", message
    else:
        assert message == (f"--data-path {prefix}: {prefix}{ext} is empty (0 bytes): rebuild the pair with Megatron-LM's "
                           "preprocess tool (tools/preprocess_data.py)"), message


# ------------------------------------------------------------------------------- a HOME for the caches
def test_a_home_that_cannot_hold_the_caches_is_named_at_parse_time(tmp_path, capsys, monkeypatch):
    """HOME unusable with --dmuon-balance milp: the start-up check walked the path as written (a HOME that
    is a link into a file passed it), the first plan-cache write failed after the model was built. Now
    the real path is checked: the cache and its variable are named at parse time, one cache at a time."""
    (tmp_path / "afile").write_text("")
    home = tmp_path / "home"
    os.symlink(tmp_path / "afile" / "sub", home)
    monkeypatch.setenv("HOME", str(home))
    for name in ("DMUON_PLAN_CACHE", "DMUON_PROFILE_CACHE", "DMUON_AUTOTUNE_CACHE"):
        monkeypatch.delenv(name)
    message = _refused(["--dmuon-balance", "milp", "--parse-only"], capsys)
    assert message == (f"the autotune cache {home}/.cache/megatron_dmuon/autotune.json cannot be created: "
                       f"{tmp_path / 'afile'} is not a directory: point $DMUON_AUTOTUNE_CACHE (or --dmuon-autotune-cache) "
                       "at a writable file path"), message
    monkeypatch.setenv("DMUON_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
    message = _refused(["--dmuon-balance", "milp", "--parse-only"], capsys)
    assert message.startswith(f"the DMuon owner plan cache {home}/.cache/megatron_dmuon/owner_plans.json cannot be "
                              f"created") and message.endswith("point $DMUON_PLAN_CACHE at a writable file path"), message


@pytest.mark.skipif(os.geteuid() == 0, reason="root searches a folder of mode 000")
def test_a_home_that_cannot_be_searched_is_named_at_parse_time(tmp_path, capsys, monkeypatch):
    """A HOME of mode 000: a PermissionError traceback from the start-up check."""
    home = tmp_path / "home"
    home.mkdir(mode=0)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DMUON_AUTOTUNE_CACHE")
    try:
        message = _refused(["--dmuon-balance", "milp", "--parse-only"], capsys)
    finally:
        home.chmod(0o700)
    assert "autotune cache" in message and "cannot be reached: Permission denied" in message, message


# ------------------------------------------------------------------------------- a full disk at --save
def _writer_failure():
    """What torch DCP raises when megatron-core's async file writer fails: the worker's error is logged,
    the exception carries only its type."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    return CheckpointException("CheckpointException ranks", {r: _wrap_exception(RuntimeError(
        "Worker failure: An error is caught while starting worker 0, error: <class 'RuntimeError'>"))
        for r in (0, 1)})


@pytest.mark.parametrize("signal_", ["logged", "free_space", "other"])
def test_a_full_disk_at_save_keeps_its_message_through_the_filter(tmp_path, capsys, monkeypatch, signal_):
    """A full disk during --save under run_main.sh: one cut line, `...failed (CheckpointException:
    CheckpointException ranks:dict_keys([0, 1])` (DCP's multi-line message; the filter keeps the error's
    first line), never "no space left" nor the checkpoint kept (row 75). Now the writers' logged error or
    the disk's free space names it, in one line, whole after the filter; another failure is one line too.
    (A real full tmpfs gives the same line; CI cannot mount one.)"""
    import torch.distributed as dist

    from megatron_dmuon.megatron.checkpoint import job as checkpoint_io
    from megatron_dmuon.megatron.train import checkpoints

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")

    def failing_save(*a, **k):
        if signal_ == "logged":  # megatron-core's filesystem_async worker
            logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").error(
                "Local worker 0 encountered an error: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        raise _writer_failure()

    monkeypatch.setattr(checkpoint_io, "save_checkpoint", failing_save)
    monkeypatch.setattr(checkpoints, "model_config_of", lambda args: {})
    if signal_ == "free_space":
        monkeypatch.setattr(checkpoints, "_free_bytes", lambda directory: 4096)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(SystemExit) as exit_info:
            checkpoints.save(argparse.Namespace(save=str(tmp_path)), 4, None, None,
                             argparse.Namespace(state_dict=lambda: {}), 0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1, err
    (tmp_path / "job.err").write_text("rank line\n" + err + "torchrun's report\n")
    filtered = subprocess.run([sys.executable, FILTER, "bash", "-c", f"cat {tmp_path / 'job.err'} >&2; exit 1"],
                              capture_output=True, text=True, timeout=60).stderr
    kept = "iteration 2 is still the latest complete checkpoint there (the tracker was not moved)"
    if signal_ == "other":
        assert "failed (RuntimeError: Worker failure: An error is caught while starting worker 0" in filtered and \
            kept in filtered and "torchrun's report" not in filtered, filtered
        return
    assert filtered == (f"rank line\ndmuon-train: error: --save {tmp_path}: writing the checkpoint of iteration 4 failed "
                        f"(no space left on device: the disk holding it is full); {kept}; free space there, or save "
                        "elsewhere\n"), filtered


# ------------------------------------------------------------------------------- dmuon plan's files
def _limited_memory():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # (a file read to the end fails fast, not by the OOM killer)


DEVICE_CASES = {  # id: (command, the one line); each reads /dev/zero where it does not check first
    "plan_rank_model": (["-m", "megatron_dmuon.cli", "plan", "--preset", "tiny", "--dp", "2", "--rank-model", "/dev/zero"],
                        "dmuon plan: error: --rank-model /dev/zero is not a regular file (a device, FIFO or socket): "
                        "give a file"),
    "plan_profile": (["-m", "megatron_dmuon.cli", "plan", "--preset", "tiny", "--dp", "2", "--profile", "/dev/zero"],
                     "dmuon plan: error: --profile /dev/zero is not a regular file (a device, FIFO or socket): give a file"),
    "plan_config": (["-m", "megatron_dmuon.cli", "plan", "--preset", "tiny", "--dp", "2", "--config", "/dev/zero"],
                    "dmuon plan: error: --config /dev/zero is not a regular file (a device, FIFO or socket): give a file"),
    "plan_show": (["-m", "megatron_dmuon.cli", "plan", "--show", "/dev/zero"],
                  "dmuon plan: error: --show /dev/zero is not a regular file (a device, FIFO or socket): give a file"),
    "trace_streams": ([os.path.join(BENCH, "trace_streams.py"), "/dev/zero"],
                      "trace_streams.py: error: trace /dev/zero is not a regular file (a device, FIFO or socket); give a "
                      "Chrome trace (JSON, or .json.gz) of the main job's --profile-out"),
    "rank_balance": ([os.path.join(BENCH, "rank_balance.py"), "scale", "--emulation", "/dev/zero"],
                     "rank_balance.py: error: --emulation /dev/zero is not a regular file (a device, FIFO or socket); "
                     "give the JSON of a rank_balance.py emulate run (--out STEM writes STEM.json)"),
}


@pytest.mark.parametrize("case", sorted(DEVICE_CASES))
def test_a_device_named_as_an_input_file_is_refused_unread(case):
    """`dmuon plan --rank-model /dev/zero` read until the OOM killer ended it (24 GB). Every file a tool
    reads is checked first: a regular file of bounded size. (Run under a 3 GiB address-space limit: a
    tool that reads it fails fast instead of taking the machine's memory.)"""
    cmd, line = DEVICE_CASES[case]
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          preexec_fn=_limited_memory, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2 and proc.stderr == line + "\n", proc.stderr[-2000:]


def test_a_cache_larger_than_any_of_ours_is_refused_unread(tmp_path, monkeypatch):
    """The caches' reader took any regular file whole into memory; one past the bound is refused by name
    and left as it is (the bound lowered here: a real one is 256 MiB)."""
    from megatron_dmuon import json_store
    from megatron_dmuon.planning.caches import PlanCache

    path = tmp_path / "plans.json"
    path.write_text('{"entries": {}, "version": 1, "pad": "' + "x" * 100 + '"}')
    before = path.read_bytes()
    monkeypatch.setattr(json_store, "CACHE_LIMIT", 64)
    with pytest.raises(ValueError, match=f"the DMuon owner plan cache {path} is not a DMuon owner plan cache file "
                                         rf"\(it holds {len(before)} bytes, more than a cache holds \(64\)"):
        PlanCache(str(path)).check_writable()
    assert path.read_bytes() == before


# ------------------------------------------------------------------------------- bench/'s CLIs
BENCH_CASES = {  # id: (script, argv, what the one line says); FILE names a file the test writes
    "rank_balance_check_no_input": ("rank_balance.py", ["check"], "check needs --emulation"),
    "rank_balance_scale_no_input": ("rank_balance.py", ["scale"], "scale needs --emulation"),
    "rank_balance_missing": ("rank_balance.py", ["check", "--emulation", "MISSING", "--models", "a=MISSING"],
                             "--emulation MISSING cannot be read: No such file or directory; give the JSON of a "
                             "rank_balance.py emulate run"),
    "rank_balance_garbage": ("rank_balance.py", ["check", "--emulation", "GARBAGE", "--models", "a=GARBAGE"],
                             "--emulation GARBAGE is not JSON (Expecting value"),
    "rank_balance_empty": ("rank_balance.py", ["report", "--emulation", "EMPTY", "--models", "a=EMPTY"],
                           "--emulation EMPTY is empty"),
    "rank_balance_list": ("rank_balance.py", ["check", "--emulation", "LIST", "--models", "a=LIST"],
                          "--emulation LIST holds a JSON list, not an object"),
    "rank_balance_no_layouts": ("rank_balance.py", ["check", "--emulation", "NO_LAYOUTS", "--models", "a=LIST"],
                                "its 'layouts' must map each layout to its 'plans' and 'jobs' (it holds no layout)"),
    "rank_balance_models_pair": ("rank_balance.py", ["check", "--emulation", "EMULATION", "--models", "LIST"],
                                 "--models LIST: give NAME=PATH"),
    "rank_balance_models_shape": ("rank_balance.py", ["check", "--emulation", "EMULATION", "--models", "a=EMULATION"],
                                  "--models EMULATION holds no 'stacks' or 'jobs' or 'entries' or 'models'"),
    "rank_balance_flags": ("rank_balance.py", ["emulate", "--rounds", "0", "--device", "cpu",
                                               "--flags=--dmuon-fraction 0.5"], "--flags: --dmuon-fraction 0.5 applies to"),
    "fp8_ns_cuda": ("fp8_ns.py", ["--device", "cuda", "--out", "OUT"], "--device cuda: no CUDA device here"),
    "ns_shapes": ("ns.py", ["time", "--shapes", "3584x"], "--shapes: bad shape '3584x'"),
    "ns_profile_cuda": ("ns.py", ["profile"], "--device cuda: no CUDA device here"),
    "momentum_garbage": ("momentum_spectra.py", ["evaluate", "GARBAGE", "--device", "cpu"],
                         "evaluate: GARBAGE does not load as a torch file of tensors"),
    "band_missing_keys": ("megatron_lm_band.py", ["--tree", "a", "NO_LAYOUTS"],
                          "--tree a NO_LAYOUTS holds no 'summary' and 'iterations'"),
    "quality_resume": ("quality.py", ["--out", "OUT", "--resume", "LIST"], "--resume LIST holds a JSON list"),
    "trace_garbage": ("trace_streams.py", ["GARBAGE"], "trace GARBAGE is not JSON"),
    "kernels_cache": ("kernels.py", ["--smoke", "--cache", "GARBAGE"], "--cache GARBAGE: the autotune cache"),
    "scaling_cluster": ("scaling.py", ["simulate", "--clusters", "nosuch"], "--clusters nosuch: cluster 'nosuch'"),
    "switch_tree": ("megatron_lm_switch.py", ["--megatron-lm", "MISSING"], "--megatron-lm MISSING is not a directory"),
    "plan_startup_preset": ("plan_startup.py", ["--preset", "nosuch", "--cache-dir", "OUT"],
                            "argument --preset: invalid choice: 'nosuch'"),
}


@pytest.mark.parametrize("case", sorted(BENCH_CASES))
def test_bench_clis_give_one_line_errors(case, tmp_path, capsys, monkeypatch):
    """Each bench/ CLI on a missing, empty, garbage or wrong-shaped input, or a device the machine lacks:
    `PROG: error: ...` in one line, exit 2, no traceback (`rank_balance.py check` with no input printed an
    empty table and exited 0; with a missing or garbage JSON, and `fp8_ns.py --device cuda` without CUDA,
    tracebacks)."""
    import importlib

    import torch

    script, argv, says = BENCH_CASES[case]
    if "--device cuda" in says and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    files = {"MISSING": tmp_path / "missing.json", "GARBAGE": tmp_path / "garbage.json", "EMPTY": tmp_path / "empty.json",
             "LIST": tmp_path / "list.json", "NO_LAYOUTS": tmp_path / "no_layouts.json",
             "EMULATION": tmp_path / "emulation.json", "OUT": tmp_path / "out"}
    files["GARBAGE"].write_text("garbage{")
    files["EMPTY"].write_text("")
    files["LIST"].write_text("[1, 2]")
    files["NO_LAYOUTS"].write_text('{"layouts": {}}')
    files["EMULATION"].write_text('{"layouts": {"tiny/dp2/one": {"plans": {}, "jobs": {}}}}')

    def spelled(text):  # the placeholders as the files' paths
        for name, path in files.items():
            text = text.replace(name, str(path))
        return text

    argv = [spelled(a) for a in argv]
    monkeypatch.syspath_prepend(BENCH)
    monkeypatch.setattr(sys, "argv", [script, *argv])  # (argparse's prog; momentum_spectra and plan_startup read it)
    module = importlib.import_module(script[:-3])
    with pytest.raises(SystemExit) as exit_info:
        module.main() if script in ("momentum_spectra.py", "plan_startup.py") else module.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"{script}: error: ") and spelled(says) in err, err
