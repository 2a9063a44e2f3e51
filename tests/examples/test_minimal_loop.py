"""The README's Python snippet (examples/minimal_loop.py) trains on 2 gloo ranks under torchrun, and the
same loop without `ddp.finish_grad_sync()` fails loudly instead of stepping on unreduced gradients (on ranks
forked from the tests' fork server, as torchrun would run it: testing/multiproc.run_script_job)."""
import os
import re
import subprocess
import sys

from megatron_dmuon.testing.multiproc import run_script_job
from tests import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "minimal_loop.py")


def _torchrun(script):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           script], capture_output=True, text=True, env=env, timeout=600)


def test_snippet_trains():
    proc = _torchrun(EXAMPLE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, proc.stdout


def test_forgetting_finish_grad_sync_is_an_error(tmp_path):
    source = open(EXAMPLE).read()
    assert "    ddp.finish_grad_sync()" in source
    script = tmp_path / "no_sync.py"
    script.write_text(source.replace("    ddp.finish_grad_sync()", "    pass  # forgot"))
    proc = run_script_job(str(script))
    assert proc.returncode != 0
    assert "before the gradients were reduced to their owners: call ddp.finish_grad_sync()" in proc.stderr
