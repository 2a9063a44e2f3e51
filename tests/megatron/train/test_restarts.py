"""The main job under `torchrun --max-restarts`: a rank SIGKILLed at iteration 7 takes the job
down, torchrun restarts it, the job resumes from the latest checkpoint (iteration 5) and ends
with exactly the parameters and optimizer state of a run that was never interrupted."""
import os
import shlex
import subprocess
import sys
import uuid

import torch

from megatron_dmuon.testing.multiproc import run_main_job
from megatron_dmuon.testing.processes import kill_marked, left_behind

ARGS = ["--train-iters", "10", "--log-interval", "1", "--seq-length", "32", "--hidden-size", "64",
        "--ffn-hidden-size", "128", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr-warmup-iters", "2",
        "--save-interval", "5"]


def _torchrun(tmp_path, name, *extra):
    """The documented path: torchrun --max-restarts 1 ... | tee. megatron-core's checkpoint
    writer (a multiprocessing Manager per saving rank) outlived the SIGKILLed rank and kept the pipe
    open: the restart trained to its summary, then tee, and the pipeline, never ended. Now the pipeline
    returns 0 and no process of the job is left (megatron_dmuon/megatron/child_processes.py)."""
    marker = uuid.uuid4().hex
    log = tmp_path / f"{name}.log"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", DMUON_TEST_MARK=marker)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "megatron_dmuon.testing.cpu_train", *ARGS,
           "--save", str(tmp_path / name), *extra]
    pipeline = f"set -o pipefail; {shlex.join(cmd)} 2>&1 | tee {shlex.quote(str(log))} >/dev/null"
    try:
        code = subprocess.run(["bash", "-c", pipeline], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=env, timeout=300).returncode
        left = left_behind(marker)
    finally:
        kill_marked(marker)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert not left, f"processes of the job left behind: {left}"
    return text


def _final_state(tmp_path, name):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(tmp_path / name / "iter_0000010"), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def _uninterrupted(tmp_path, name):
    """The reference: the same job, never interrupted, on ranks forked from the tests' fork server
    (testing/multiproc.run_main_job: torchrun's environment; what is tested here is the restart under
    the real torchrun, not the reference's launcher)."""
    proc = run_main_job([*ARGS, "--save", str(tmp_path / name)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("> summary ") == 1, proc.stdout[-3000:]


def test_killed_rank_restarts_from_the_checkpoint_and_ends_equal(tmp_path):
    _uninterrupted(tmp_path, "uninterrupted")
    log = _torchrun(tmp_path, "killed", "--load", str(tmp_path / "killed"), "--fail-at-iteration", "7")
    assert "fault injection: SIGKILL rank 1 at iteration 7" in log
    assert "loaded checkpoint" in log and "iter_0000005 at iteration 5" in log
    assert "all DP replicas hold identical parameters" in log  # published after the load
    assert log.count("> summary ") == 1, log[-3000:]  # the restart's, then the pipeline ended (_torchrun)
    reference, resumed = _final_state(tmp_path, "uninterrupted"), _final_state(tmp_path, "killed")
    assert set(reference) == set(resumed) and any(k.startswith("optimizer.state.momentum_buffer") for k in reference)
    different = [k for k in reference if not torch.equal(reference[k], resumed[k])]
    assert not different, different[:5]
