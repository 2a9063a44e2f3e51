"""The launcher (docs/bad_input.md): a rank SIGKILLed after a save hung
launch/run_main.sh forever (megatron-core's checkpoint writer Manager of the dead rank kept the stderr
pipe open), Ctrl-C printed a traceback of the stderr filter, `run_main.sh -h` printed the help twice
after 22 s, relative paths landed in the checkout (the scripts changed directory), and a damaged venv
was reused unnoticed and never repaired.

One real run of the main job (under launch/run_main.sh, from another directory, with relative paths);
the filter, the children's guard and the venv check are tested on small
stand-ins (no torch)."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from tests.megatron.train.main_job import SMALL

from megatron_dmuon.testing.processes import kill_marked, left_behind

from tests import ROOT

RUN_MAIN = os.path.join(ROOT, "launch", "run_main.sh")
FILTER = os.path.join(ROOT, "launch", "after_job_error.py")
CHECK_ENV = os.path.join(ROOT, "launch", "check_env.py")
SETUP_ENV = os.path.join(ROOT, "launch", "setup_env.sh")


def _dataset(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in range(40):
        builder.add_document(np.arange(d, d + 200, dtype=np.int32) % 50, [200])
    builder.finalize(prefix + ".idx")


def _run_main(cwd, marker, *argv, limit_s=240):
    """launch/run_main.sh ARGV from ``cwd`` in its own session; (exit code, stdout, stderr, seconds from
    the fault injection's line to the end or None)."""
    env = dict(os.environ, DMUON_TEST_MARK=marker, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               DMUON_PLAN_CACHE=str(cwd / "plans.json"), DMUON_PROFILE_CACHE=str(cwd / "profile.json"),
               DMUON_AUTOTUNE_CACHE=str(cwd / "tune.json"))
    out, err = cwd / f"{marker}.out", cwd / f"{marker}.err"
    with open(out, "w") as o, open(err, "w") as e:  # files: a process left holding a pipe cannot hang the test
        proc = subprocess.Popen(["bash", RUN_MAIN, *SMALL, *map(str, argv)], cwd=cwd, stdout=o, stderr=e, env=env,
                                start_new_session=True)
    killed_at, start = None, time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - start < limit_s:
            if killed_at is None and "> fault injection" in out.read_text():
                killed_at = time.monotonic()
            if killed_at is not None and time.monotonic() - killed_at > 60:
                break
            time.sleep(0.2)
        ended = proc.poll() is not None
        after_kill = time.monotonic() - killed_at if killed_at is not None else None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert ended, f"run_main.sh still running {after_kill} s after the rank was killed:\n" + err.read_text()[-3000:]
    return proc.returncode, out.read_text(), err.read_text(), after_kill


# ---------------------------------------------------------------- 4A-1, 4A-4: the hang; relative paths
def test_a_rank_killed_after_a_save_ends_run_main_and_leaves_nothing_behind(tmp_path):
    """A rank SIGKILLed at iteration 3, after the save of iteration 2: run_main.sh ended only when
    killed (the dead rank's checkpoint-writer Manager and multiprocessing's resource tracker kept its
    stderr pipe open). Now: exit 1 within 30 s, no process of the job left. Run from another directory
    with a relative --data-path (read) and --save (written): both in that directory (the scripts changed
    to the checkout: the data was reported missing, the checkpoint written there)."""
    (tmp_path / "data").mkdir()
    _dataset(str(tmp_path / "data" / "tok"))
    marker = uuid.uuid4().hex
    try:
        code, out, err, after_kill = _run_main(tmp_path, marker, "--train-iters", 4, "--save-interval", 2,
                                               "--fail-at-iteration", 3, "--data-path", "data/tok", "--save", "ckpt")
        left = left_behind(marker)
    finally:
        kill_marked(marker)
    assert code == 1 and after_kill is not None and after_kill < 30, (code, after_kill, err[-3000:])
    assert not left, f"processes of the job left behind: {left}"
    assert "after_job_error" not in err, err[-3000:]
    assert "> saved checkpoint ckpt/iter_0000002" in out and "iteration        2/" in out, out[-2000:]
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir() and not os.path.exists(os.path.join(ROOT, "ckpt"))


# --------------------------------------------------------------------------- 4A-1: the children's guard
GUARDED_PARENT = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys, threading, time
    from megatron_dmuon.megatron.child_processes import install

    def sleep():
        time.sleep(300)

    if __name__ == "__main__":
        install()
        manager = mp.get_context("spawn").Manager()  # what megatron-core's checkpoint writer starts
        queue = manager.Queue()
        forked = mp.get_context("fork").Process(target=sleep)  # --async-save's writer
        forked.start()
        from_thread = []  # a child started by a thread that ends before the parent: it must live on

        def start_from_thread():
            from_thread.append(mp.get_context("fork").Process(target=sleep))
            from_thread[0].start()

        t = threading.Thread(target=start_from_thread)
        t.start(); t.join()
        time.sleep(1.0)
        print(manager._process.pid, forked.pid, from_thread[0].pid, flush=True)
        assert from_thread[0].is_alive() and forked.is_alive()
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_children_of_a_killed_process_die_with_it(tmp_path):
    """megatron_dmuon.megatron.child_processes: a spawned Manager (megatron-core's write-results queue),
    a forked writer and a child forked from a thread all end when their SIGKILLed parent does; the
    child of the thread lives on while the parent does (no PR_SET_PDEATHSIG tied to the thread)."""
    script = tmp_path / "parent.py"
    script.write_text(GUARDED_PARENT)
    marker = uuid.uuid4().hex
    try:
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, DMUON_TEST_MARK=marker), start_new_session=True)
        left = left_behind(marker, wait_s=5.0)
    finally:
        kill_marked(marker)
    assert proc.returncode == -signal.SIGKILL and len(proc.stdout.split()) == 3, proc.stdout + proc.stderr[-2000:]
    assert not left, f"children outlived their parent: {left}"


# ----------------------------------------------------------------------- 4A-1, 4A-2: the stderr filter
def _filter(shell, **kw):
    return subprocess.Popen([sys.executable, FILTER, "bash", "-c", shell], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True, text=True, **kw)


def test_the_filter_ends_when_its_command_ends_whatever_its_children_do():
    """A child of the command keeps stderr open (a checkpoint writer that outlived its rank): the filter
    ended only at that child's end. Now it ends with the command, passes its lines on up to the job's
    error line, and exits with its status."""
    marker = uuid.uuid4().hex
    proc = _filter('sleep 120 & echo "rank line" >&2; echo "dmuon-train: error: boom" >&2; '
                   'echo "torchrun report" >&2; exit 3', env=dict(os.environ, DMUON_TEST_MARK=marker))
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        kill_marked(marker)  # the sleep (in the command's own process group)
    assert proc.returncode == 3 and "rank line\ndmuon-train: error: boom\n" in err and "torchrun report" not in err, err


def test_ctrl_c_and_a_closed_stderr_are_quiet(tmp_path):
    """Ctrl-C (SIGINT to the foreground process group) printed a KeyboardInterrupt traceback of
    after_job_error.py; now one line, the command's status. A closed stderr: the filter reads on (the
    command does not block on a full pipe) and exits with the command's status."""
    err_file = tmp_path / "err"
    with open(err_file, "w") as err:
        proc = subprocess.Popen([sys.executable, FILTER, sys.executable, "-c",
                                 "import sys, time\nprint('started', file=sys.stderr, flush=True)\ntime.sleep(60)"],
                                stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while "started" not in err_file.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = err_file.read_text()
    assert proc.returncode == 130 and "Traceback" not in text, text
    assert "started" in text and "interrupted: SIGINT passed on to python" in text, text

    r, w = os.pipe()
    os.close(r)  # nobody reads the filter's stderr
    proc = subprocess.Popen([sys.executable, FILTER, sys.executable, "-c",
                             "import sys\nfor i in range(20000): print('x' * 100, file=sys.stderr)\nsys.exit(4)"],
                            stderr=w, start_new_session=True)
    os.close(w)
    assert proc.wait(timeout=60) == 4


# ---------------------------------------------------------------------- 4A-3, 4A-6: -h, once and fast; NPROC
def test_run_main_help_prints_once_and_starts_no_ranks(tmp_path):
    """`run_main.sh -h`: the pre-check's help went to /dev/null, then torchrun started two ranks that
    each printed it (22 s). Now the help once, from the pre-check, and no torchrun. NPROC is checked."""
    proc = subprocess.run(["bash", RUN_MAIN, "-h"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.count("usage: dmuon-train") == 1, proc.stdout[-500:] + proc.stderr
    assert "torch.distributed" not in proc.stderr and "--data-path" in proc.stdout, proc.stderr[-2000:]
    proc = subprocess.run(["bash", RUN_MAIN, "--train-iters", "2"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=dict(os.environ, NPROC="two"))
    assert proc.returncode == 2 and "NPROC (the number of ranks) must be a whole number >= 1 (got 'two')" \
        in proc.stderr and "torch.distributed" not in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------------------ 4A-5: a damaged venv
def _fake_dist(site, name, version, files):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},sha256=x,1\n" for f in files) + f"{info.name}/RECORD,,\n")


@pytest.mark.parametrize("case", ["psutil_deleted", "megatron_core_subpackage_deleted", "whole"])
def test_check_env_names_a_damaged_package(tmp_path, case):
    """launch/check_env.py (setup_env.sh's check of a reused venv) against a venv whose psutil lost its
    files, or whose megatron-core lost a subpackage (a shadowing dist-info on PYTHONPATH stands for the
    damaged install): named, with the pip arguments that reinstall it; the real venv passes."""
    site = tmp_path / "site"
    site.mkdir()
    if case == "psutil_deleted":
        _fake_dist(site, "psutil", "9.9.9", ["psutil/__init__.py", "psutil/_psutil_linux.so"])
    elif case == "megatron_core_subpackage_deleted":
        _fake_dist(site, "megatron-core", "0.19.2", ["megatron/core/optimizer/__init__.py"])
    proc = subprocess.run([sys.executable, CHECK_ENV], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(site)))
    if case == "whole":
        assert proc.returncode == 0 and proc.stdout == proc.stderr == "", proc.stdout + proc.stderr
    elif case == "psutil_deleted":
        assert proc.returncode == 1 and proc.stdout == "--force-reinstall --no-deps psutil==9.9.9\n", proc.stdout
        assert "psutil 9.9.9 is damaged: psutil/__init__.py is missing (and 1 more of its files)" in proc.stderr
    else:
        assert proc.returncode == 1 and proc.stdout == \
            "--force-reinstall --no-deps --ignore-requires-python megatron-core==0.19.2\n", proc.stdout
        assert "megatron-core 0.19.2 is damaged: megatron/core/optimizer/__init__.py is missing" in proc.stderr


def test_setup_env_repairs_a_damaged_venv_and_keeps_the_fast_path(tmp_path):
    """launch/setup_env.sh on a venv stand-in (the real venv's Python behind a damaged psutil dist-info
    and a pip that logs its arguments): a stamped venv with psutil damaged was reused as is; now psutil
    is reinstalled (--force-reinstall) and the stamp kept; the next start runs no pip; with the stamp
    removed a damaged megatron-core is reinstalled too; a repair that does not hold fails naming it."""
    venv, site = tmp_path / "venv", tmp_path / "site"
    (venv / "bin").mkdir(parents=True)
    (site / "pip").mkdir(parents=True)
    log = tmp_path / "pip.log"
    (site / "pip" / "__init__.py").write_text("")
    (site / "pip" / "__main__.py").write_text(textwrap.dedent(f"""
        import os, sys
        with open({str(log)!r}, "a") as f:
            f.write(" ".join(sys.argv[1:]) + "\\n")
        if os.environ.get("FAKE_PIP_REPAIRS") and "psutil==9.9.9" in sys.argv:
            os.makedirs({str(site / "psutil")!r}, exist_ok=True)
            for name in ("__init__.py", "_psutil_linux.so"):
                open(os.path.join({str(site / "psutil")!r}, name), "w").close()
        if os.environ.get("FAKE_PIP_REPAIRS") and any(a.startswith("megatron-core") for a in sys.argv):
            os.makedirs({str(site / "megatron" / "core" / "optimizer")!r}, exist_ok=True)
            open({str(site / "megatron" / "core" / "optimizer" / "__init__.py")!r}, "w").close()
    """))
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/bash\nPYTHONPATH="{site}" exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv}/bin:$PATH"\n')
    _fake_dist(site, "psutil", "9.9.9", ["psutil/__init__.py", "psutil/_psutil_linux.so"])
    want = hashlib.sha1(b"".join(open(os.path.join(ROOT, p), "rb").read() for p in
                                 ("setup.cfg", "launch/setup_env.sh", "launch/check_env.py"))).hexdigest()[:16]
    (venv / ".dmuon-installed").write_text(want + "\n")

    def setup(**env):
        if log.exists():
            log.unlink()
        proc = subprocess.run(["bash", SETUP_ENV], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, DMUON_VENV=str(venv), **env))
        return proc, (log.read_text().splitlines() if log.exists() else [])

    proc, calls = setup(FAKE_PIP_REPAIRS="1")
    assert proc.returncode == 0, proc.stderr
    assert calls == ["install -q --disable-pip-version-check --force-reinstall --no-deps psutil==9.9.9"], calls
    assert "psutil 9.9.9 is damaged" in proc.stderr and "reinstalling" in proc.stderr, proc.stderr
    assert (venv / ".dmuon-installed").read_text().strip() == want

    proc, calls = setup()  # whole again: the fast path, no pip
    assert proc.returncode == 0 and calls == [] and proc.stderr == "", (calls, proc.stderr)

    (venv / ".dmuon-installed").unlink()  # the stamp removed: still repaired (it was never, before)
    _fake_dist(site, "megatron-core", "0.19.2", ["megatron/core/optimizer/__init__.py"])
    proc, calls = setup(FAKE_PIP_REPAIRS="1")
    assert proc.returncode == 0, proc.stderr
    assert "install -q --disable-pip-version-check --force-reinstall --no-deps --ignore-requires-python " \
           "megatron-core==0.19.2" in calls and (venv / ".dmuon-installed").exists(), calls

    os.unlink(site / "psutil" / "__init__.py")  # and a pip that does not repair it
    proc, calls = setup()
    assert proc.returncode == 1 and "psutil 9.9.9 is damaged" in proc.stderr, proc.stderr
    assert "still not whole after installing" in proc.stderr and f"rm -rf {venv}" in proc.stderr, proc.stderr
