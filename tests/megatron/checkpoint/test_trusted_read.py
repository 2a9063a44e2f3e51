"""A file from elsewhere is data: reading it never runs code (docs/checkpoints.md
"What is trusted"). Each case plants a pickle whose ``__reduce__`` would create a marker file where a
checkpoint, a torch file, a cache or a JSON input belongs, runs the reader a user would run, and
checks that the reader names the file and that the marker never appears."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from tests import ROOT


class _PlantsMarker:
    """Unpickling this calls open(marker, 'w'): code run by reading a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _payload(marker) -> bytes:
    return pickle.dumps({"state": _PlantsMarker(marker)})


def _checkpoint_root(tmp_path, marker):
    """A --load directory in the main job's layout whose iteration 2 holds a planted .metadata."""
    root = tmp_path / "ckpt"
    iteration = root / "iter_0000002"
    iteration.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (iteration / ".metadata").write_bytes(_payload(marker))
    (iteration / "__0_0.distcp").write_bytes(b"\0" * 64)
    return root, iteration / ".metadata"


def test_the_planted_pickle_does_run_code_when_unpickled(tmp_path):
    # the fixture is live: plain pickle.load runs it (so the tests below would see the marker)
    marker = tmp_path / "ran"
    pickle.loads(_payload(marker))
    assert marker.exists()


@pytest.mark.parametrize("how", ["parse_only", "run_main_load"])
def test_a_checkpoint_whose_metadata_holds_code_is_refused_unread(tmp_path, how):
    marker = tmp_path / "ran"
    root, metadata = _checkpoint_root(tmp_path, marker)
    if how == "parse_only":
        cmd = [sys.executable, "-m", "megatron_dmuon.testing.cpu_train", "--load", str(root), "--train-iters", "8",
               "--parse-only"]
    else:  # the main job as a user starts it: the pre-check runs before torchrun
        cmd = ["bash", os.path.join(ROOT, "launch", "run_main.sh"), "--load", str(root), "--train-iters", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert str(metadata) in proc.stderr and "io.open" in proc.stderr and "refused unread" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists()


def test_every_checkpoint_reader_checks_the_metadata_first(tmp_path):
    from megatron_dmuon.megatron.checkpoint import checkpoint_problem, load_checkpoint
    from megatron_dmuon.megatron.checkpoint.trusted_read import UntrustedCheckpointError, check_load_dir_is_data

    marker = tmp_path / "ran"
    root, metadata = _checkpoint_root(tmp_path, marker)
    iteration = str(metadata.parent)
    for read in (lambda: checkpoint_problem(iteration),  # the start-up checks
                 lambda: load_checkpoint(iteration, [], None),  # the main job's and megatron-core loops' load
                 lambda: check_load_dir_is_data(str(root)),  # Megatron-LM's and Bridge's routed loads (tracker)
                 lambda: check_load_dir_is_data(str(root), 2),  # --ckpt-step
                 lambda: check_load_dir_is_data(iteration)):  # a directory that is one checkpoint
        with pytest.raises(UntrustedCheckpointError, match="io.open"):
            read()
    assert not marker.exists()


def test_an_honest_metadata_reads_as_torch_reads_it(tmp_path):
    # the allow-list admits what torch DCP and megatron-core write: a real dist checkpoint
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_dmuon.megatron.checkpoint.trusted_read import trusted_dcp_metadata
    from megatron_dmuon.testing.multiproc import run_distributed

    path = tmp_path / "real"
    path.mkdir()
    run_distributed("megatron_dmuon.testing.checkpoint_workers:save_tiny_dist_checkpoint", 1, kwargs=dict(path=str(path)))
    ours, torchs = trusted_dcp_metadata(str(path)), FileSystemReader(str(path)).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.storage_data == torchs.storage_data
    assert {"weight", "extra"} <= {k.split("/")[0] for k in ours.state_dict_metadata}


def test_a_torch_format_file_holding_code_is_refused_on_every_rank(tmp_path):
    from megatron_dmuon.testing.multiproc import run_distributed

    marker = tmp_path / "ran"
    planted = tmp_path / "distrib_optim.pt"
    import torch

    torch.save({"dmuon": {}, "params": {"x": _PlantsMarker(marker)}}, planted)
    results = run_distributed("megatron_dmuon.testing.checkpoint_workers:load_param_state_file_errors", 2,
                              kwargs=dict(filename=str(planted)))
    assert all(str(planted) in r and "weights-only" in r for r in results), results
    assert not marker.exists()


def test_caches_holding_a_pickle_are_not_unpickled(tmp_path):
    # the autotune, profile and plan caches are JSON: a pickle there is a foreign file or an unreadable cache,
    # named, never run
    from megatron_dmuon.kernels.autotune import AutotuneCache
    from megatron_dmuon.planning.caches import PlanCache, ProfileCache

    marker = tmp_path / "ran"
    for cls in (AutotuneCache, PlanCache, ProfileCache):
        path = tmp_path / f"{cls.__name__}.json"
        path.write_bytes(_payload(marker))
        with pytest.raises(Exception) as info:
            cls(str(path)).entries
        assert str(path) in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("flag", ["--show", "--profile", "--rank-model"])
def test_json_inputs_holding_a_pickle_are_named_and_not_unpickled(tmp_path, flag):
    marker = tmp_path / "ran"
    planted = tmp_path / "input.json"
    planted.write_bytes(_payload(marker))
    extra = [] if flag == "--show" else ["--preset", "tiny", "--dp", "2"]
    proc = subprocess.run([sys.executable, "-m", "megatron_dmuon.planning.plan_cli", flag, str(planted), *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and str(planted) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists()


def test_a_save_into_a_link_made_after_the_start_up_check_is_refused_on_every_rank(tmp_path):
    # the start-up check refuses links where a save writes; one made later must not be
    # followed (rmtree of an 'incomplete' iteration through the link) and no rank may wait alone
    from megatron_dmuon.testing.multiproc import run_distributed

    target = tmp_path / "someone_elses"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    results = run_distributed("megatron_dmuon.testing.checkpoint_workers:save_into_a_link_errors", 2,
                              kwargs=dict(root=str(tmp_path / "ckpt"), target=str(target)))
    assert all(r.startswith("CheckpointMismatchError") and "symbolic link" in r for r in results), results
    assert (target / "keep.txt").read_text() == "mine"
