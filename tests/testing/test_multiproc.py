"""The CPU harness runs real megatron-core DDP + DistributedOptimizer on gloo."""
import os

import torch

from megatron_dmuon.testing.multiproc import run_distributed

HERE = os.path.dirname(__file__)


def test_megatron_distributed_adam_dp2_trains_and_stays_in_sync():
    results = run_distributed("megatron_dmuon.testing.workers:megatron_adam_dp", 2)
    r0, r1 = results
    # the same fixed batch every step: the loss must drop clearly
    assert r0["losses"][-1] < r0["losses"][0] - 0.05, r0["losses"]
    assert r0["losses"] == r1["losses"]
    assert r0["params"].keys() == r1["params"].keys()
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name


def where(rank, world_size):
    """A target for the tests below: who ran it, in which process and process group."""
    import torch.distributed as dist

    return {"rank": rank, "world": world_size, "pid": os.getpid(), "group_size": dist.get_world_size()}


def test_a_forked_rank_runs_its_target_once_in_a_process_of_its_own():
    import pytest

    from megatron_dmuon.testing.multiproc import ForkedRank

    with ForkedRank() as forked:
        out = forked.run("tests.testing.test_multiproc:where")
        with pytest.raises(RuntimeError, match="runs one target"):
            forked.run("tests.testing.test_multiproc:where")
    assert out["rank"] == 0 and out["world"] == out["group_size"] == 1 and out["pid"] != os.getpid()
    assert forked._proc.exitcode == 0
    unused = ForkedRank()
    unused.close()  # it was waiting for a target: ends at once
    assert unused._proc.exitcode == 0


def test_a_script_job_runs_the_file_on_every_rank_as_torchrun_does(tmp_path):
    from megatron_dmuon.testing.multiproc import run_script_job

    script = tmp_path / "job.py"
    script.write_text("import os, sys\n"
                      "print(__name__, os.environ['RANK'], os.environ['WORLD_SIZE'], sys.argv[1:], sys.path[0])\n"
                      "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = run_script_job(str(script), ["--flag", 7])
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines() == [f"__main__ {r} 2 ['--flag', '7'] {tmp_path}" for r in (0, 1)], proc.stdout
    assert run_script_job(str(script), nproc=1).returncode == 0
