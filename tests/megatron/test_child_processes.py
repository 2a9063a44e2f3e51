"""The launcher and its processes (docs/bad_input.md): a SIGKILLed torchrun left both ranks
training and writing checkpoints under pid 1 while launch/run_main.sh exited 137; SIGINT to run_main.sh
(the stderr filter, after its exec) was ignored, the job trained to its end, and the filter then said
"torchrun stopped the ranks and exited with 0"; SIGTERM ended in torchrun's SignalException traceback;
NPROC=1000 on a 2-core machine was checked and planned; `python -m megatron_dmuon.bridge` without
Megatron-Bridge was a ModuleNotFoundError traceback.

Two real runs of the main job under run_main.sh (the SIGKILL and the SIGINT cases, tiny settings, signalled
at their first iteration); SIGTERM on the filter around a real torchrun of a stand-in script."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from tests.megatron.train.main_job import SMALL

from megatron_dmuon.testing.processes import kill_marked, left_behind, marked_processes

from tests import ROOT

RUN_MAIN = os.path.join(ROOT, "launch", "run_main.sh")
FILTER = os.path.join(ROOT, "launch", "after_job_error.py")
PRECHECK = os.path.join(ROOT, "launch", "precheck.py")


def _env(tmp_path, marker, **extra):
    return dict(os.environ, DMUON_TEST_MARK=marker, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                DMUON_PLAN_CACHE=str(tmp_path / "plans.json"), DMUON_PROFILE_CACHE=str(tmp_path / "profile.json"),
                DMUON_AUTOTUNE_CACHE=str(tmp_path / "tune.json"), **extra)


def _children(pid: int) -> list:
    """The pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _started(cmd, tmp_path, marker, ready: str, limit_s=240, **env):
    """``cmd`` started in its own session with stdout/stderr in files; returned once ``ready`` shows in its
    stdout or stderr: (Popen, stdout path, stderr path)."""
    out, err = tmp_path / f"{marker}.out", tmp_path / f"{marker}.err"
    with open(out, "w") as o, open(err, "w") as e:  # files: a process left holding a pipe cannot hang the test
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=o, stderr=e, env=_env(tmp_path, marker, **env),
                                start_new_session=True)
    deadline = time.monotonic() + limit_s
    while ready not in out.read_text() + err.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, \
            f"never ready ({proc.poll()}):\n{out.read_text()[-2000:]}\n{err.read_text()[-3000:]}"
        time.sleep(0.2)
    return proc, out, err


def _ended(proc, limit_s: float) -> int:
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"still running {limit_s} s after the signal")


LONG_JOB = ["bash", RUN_MAIN, *SMALL, "--train-iters", "100000", "--eval-iters", "0"]


def test_a_sigkilled_torchrun_leaves_no_rank_running(tmp_path):
    """kill -KILL of torchrun under run_main.sh: both ranks (children of pid 1 from then on) trained on and
    wrote checkpoints. Now each rank watches torchrun (megatron/child_processes.die_with_torchrun): no process
    of the job is left 10 s later, and run_main.sh says what ended it and exits 137."""
    marker = uuid.uuid4().hex
    try:
        proc, out, err = _started(LONG_JOB, tmp_path, marker, " iteration ")
        torchrun = [pid for pid in _children(proc.pid) if "torchrun" in marked_processes(marker).get(pid, "")]
        assert len(torchrun) == 1, marked_processes(marker)
        ranks = [pid for pid, cmd in marked_processes(marker).items() if "cpu_train" in cmd and "torchrun" not in cmd]
        assert len(ranks) == 2, marked_processes(marker)
        os.kill(torchrun[0], signal.SIGKILL)
        left = left_behind(marker, wait_s=10.0)
        code = _ended(proc, 10)
    finally:
        kill_marked(marker)
    assert not left, f"processes of the job still running 10 s after torchrun was killed: {left}"
    assert code == 137 and "torchrun was killed by SIGKILL (not through this runner): exit 137" in err.read_text(), \
        (code, err.read_text()[-2000:])


def test_sigint_to_run_main_stops_the_job_with_130_and_says_so(tmp_path):
    """SIGINT to run_main.sh's pid alone (kill -INT, not the terminal's group): ignored before, the job ran to
    its end. Now the filter passes it on to torchrun: exit 130, one line saying what it saw, no traceback,
    nothing left, and the job did not reach its end."""
    marker = uuid.uuid4().hex
    try:
        proc, out, err = _started(LONG_JOB, tmp_path, marker, " iteration ")
        os.kill(proc.pid, signal.SIGINT)
        code = _ended(proc, 90)
        left = left_behind(marker, wait_s=10.0)
    finally:
        kill_marked(marker)
    text = err.read_text()
    assert code == 130, (code, text[-3000:])
    assert text.count("interrupted: SIGINT passed on to torchrun; the job was stopped before its end: "
                      "torchrun exited with 1, and every process of the job has closed its output") == 1, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "> summary" not in out.read_text() and not left, left


STAND_IN = textwrap.dedent("""
    import sys, time
    from megatron_dmuon.megatron.child_processes import die_with_torchrun
    die_with_torchrun()
    print("rank ready", file=sys.stderr, flush=True)
    time.sleep(300)
""")


def test_sigterm_to_the_runner_stops_torchrun_without_its_traceback(tmp_path):
    """SIGTERM to run_main.sh's runner: the job stopped, then torchrun's SignalException traceback. Now one
    line and exit 143 (128 + SIGTERM); the ranks are gone."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    marker = uuid.uuid4().hex
    cmd = [sys.executable, FILTER, sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(script)]
    try:
        proc, _, err = _started(cmd, tmp_path, marker, "rank ready", PYTHONPATH=ROOT)
        time.sleep(1.0)  # (the second rank's line)
        os.kill(proc.pid, signal.SIGTERM)
        code = _ended(proc, 60)
        left = left_behind(marker, wait_s=5.0)
    finally:
        kill_marked(marker)
    text = err.read_text()
    assert code == 143 and "stopped: SIGTERM passed on to python; the job was stopped before its end" \
        in text, (code, text[-3000:])
    assert "SignalException" not in text and "Traceback" not in text and not left, (left, text[-3000:])


def test_the_filter_reports_only_what_it_saw(tmp_path):
    """The filter said "torchrun stopped the ranks" of a job the signal never reached, which ended with 0.
    A command that ignores the signal and exits 0: the line says it exited with 0 nonetheless, no claim of a
    stop, exit 0."""
    marker = uuid.uuid4().hex
    cmd = [sys.executable, FILTER, sys.executable, "-c",
           "import signal, sys, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
           "print('ignoring', file=sys.stderr, flush=True)\ntime.sleep(2)\nprint('done', file=sys.stderr)"]
    try:
        proc, _, err = _started(cmd, tmp_path, marker, "ignoring")
        os.kill(proc.pid, signal.SIGINT)
        code = _ended(proc, 30)
    finally:
        kill_marked(marker)
    text = err.read_text()
    assert code == 0 and "SIGINT passed on to python, which exited with 0 nonetheless" in text, (code, text)
    assert "stopped" not in text, text


# ------------------------------------------------------------------------- NPROC bounded per host
@pytest.mark.parametrize("nproc", ["1000", "100000"])
def test_an_absurd_rank_count_is_refused_before_planning(tmp_path, nproc):
    """NPROC=1000 on a 2-core machine: the pre-check checked (and planned) 1000 ranks on one host. Now
    refused first, naming NPROC and this host's bound."""
    cores = len(os.sched_getaffinity(0))
    if int(nproc) <= 4 * cores:
        pytest.skip(f"a host of {cores} cores can run {nproc} CPU ranks")
    proc = subprocess.run([sys.executable, PRECHECK, "--dmuon-balance", "milp"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=dict(_env(tmp_path, "none"), NPROC=nproc))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"run_main.sh: error: NPROC={nproc} CPU ranks on {cores} core(s): at most 4 per "
                                   f"core ({4 * cores}); lower NPROC"), proc.stderr


# ------------------------------------------------------------------------- Bridge's launcher
def test_the_bridge_launcher_without_megatron_bridge_is_one_line(tmp_path):
    """`python -m megatron_dmuon.bridge hello.py` without Megatron-Bridge: a ModuleNotFoundError traceback
    from the adapter. Now one line naming the package and how to install it, exit 2."""
    pytest.importorskip("megatron.core")
    try:
        import megatron.bridge  # noqa: F401
        pytest.skip("Megatron-Bridge is installed here")
    except ImportError:
        pass
    (tmp_path / "hello.py").write_text("print('hello')\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_dmuon.bridge", "hello.py"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2 and "hello" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "megatron_dmuon.bridge: error: Megatron-Bridge is not installed (no module megatron.bridge): pip install "
        "megatron-bridge (docs/bridge.md), then run it again"], proc.stderr
