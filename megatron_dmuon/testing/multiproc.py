"""Run a function on N gloo ranks in fresh processes and collect each rank's return value.

The target is named as ``"module:function"`` so spawned children can import it; it is called as
``fn(rank, world_size, **kwargs)`` after ``torch.distributed`` is initialised with gloo and the
CPU shim is installed. Return values must be picklable (tensors are fine).

Ranks are forked from a fork server that has imported torch and megatron-core once (a fresh
interpreter spends ~7 s of CPU importing them, which was most of the test suite's time on two
cores). Each rank still starts clean: its own process, this call's environment, the CPU shim
installed and the process group created after the fork. ``DMUON_TEST_SPAWN=subprocess`` starts
every rank as a fresh interpreter instead, as does a call whose ``env`` sets PYTHONPATH. A forked
rank's checkpoint writer forks its results Manager rather than spawning it (see
``_fork_the_checkpoint_writers_manager``).
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what the fork server imports once (its children inherit the loaded modules, not their state)
PRELOAD = ("torch", "torch.distributed", "numpy", "megatron.core", "megatron.core.distributed",
           "megatron.core.optimizer", "megatron.core.models.gpt", "megatron_dmuon.megatron.optimizer",
           "megatron_dmuon.megatron.gpt", "megatron_dmuon.testing.cpu_shim", "megatron_dmuon.testing.workers",
           "megatron_dmuon.testing.checkpoint_workers", "megatron.core.dist_checkpointing.strategies.filesystem_async")
_CONTEXT = None


def _fork_context():
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _CONTEXT = ctx
    return _CONTEXT


def _forked_worker(spec_path: str, log_path: str, env: Dict[str, str]) -> None:
    """A forked rank: this call's environment and output file, then the same body as a fresh one."""
    import warnings

    os.environ.clear()
    os.environ.update(env)
    # the fork server made its start method ours; a fresh interpreter has the platform's default
    # (Megatron's data loader workers, started from a rank, must not need pickling)
    multiprocessing.set_start_method(None, force=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    _fork_the_checkpoint_writers_manager()
    _worker_main(spec_path)
    sys.stdout.flush()
    sys.stderr.flush()


def _fork_the_checkpoint_writers_manager() -> None:
    """In a forked rank: megatron-core's checkpoint writer keeps its write results in a Manager queue
    (``filesystem_async.get_write_results_queue``, made at a process's first save) whose server process
    it spawns; that fresh interpreter imports torch when the first results arrive (their classes), ~3 s
    of CPU per saving rank, most of a small test's save. Here the server is forked from the rank
    instead, which has torch imported: the same queue of the same results, one start method changed
    (a rank's children still die with it: megatron/child_processes.install guards forked children too).
    Ranks under torchrun, ``DMUON_TEST_SPAWN=subprocess`` and every real run keep megatron-core's
    spawned server (tests/megatron/train/test_restarts.py, tests/launch/test_run_main.py)."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    original = getattr(filesystem_async, "get_write_results_queue", None)
    if original is None:
        return

    def get_write_results_queue(mp_mode: str = "spawn"):  # (the queue is made once, at the first call)
        return original("fork" if mp_mode == "spawn" else mp_mode)

    filesystem_async.get_write_results_queue = get_write_results_queue


def _worker_main(spec_path: str) -> None:
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    rank, world_size = spec["rank"], spec["world_size"]
    out_path = spec["out_path"]
    for p in spec.get("sys_path", []):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        import torch

        torch.set_num_threads(spec.get("threads", 1))
        from megatron_dmuon.testing import cpu_shim

        cpu_shim.install()
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec['port']}",
            rank=rank,
            world_size=world_size,
        )
        module_name, fn_name = spec["target"].split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        result = {"ok": True, "value": fn(rank, world_size, **spec["kwargs"])}
    except BaseException:  # report any failure to the parent, including asserts
        result = {"ok": False, "error": traceback.format_exc()}
    with open(out_path, "wb") as f:
        pickle.dump(result, f)
    try:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except Exception:
        pass


def run_distributed(
    target: str,
    world_size: int,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = 600.0,
    sys_path: Optional[List[str]] = None,
    env: Optional[Dict[str, str]] = None,
) -> List[Any]:
    """Run ``target`` on ``world_size`` gloo ranks; return the per-rank results (rank order).

    Raises RuntimeError with every failing rank's traceback if any rank fails or times out.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return _run_in_tmp(target, world_size, kwargs, timeout, sys_path, env)


def _run_in_tmp(target, world_size, kwargs, timeout, sys_path, env, start=None) -> List[Any]:
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="dmuon-mp-")
    try:
        return _run(target, world_size, kwargs, timeout, sys_path, env, port, tmp, start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # rank results can be hundreds of MB


def _run(target, world_size, kwargs, timeout, sys_path, env, port, tmp, start=None) -> List[Any]:
    """``start(spec_path, log_path, env)``: a started process running ``_forked_worker`` on those (default: one
    forked from the fork server)."""
    procs, outs = [], []
    # a call that sets PYTHONPATH (e.g. a Megatron-LM checkout's own megatron.core) needs fresh
    # interpreters: the fork server's preloaded modules came from this process's path
    forked = start is not None or (os.environ.get("DMUON_TEST_SPAWN", "fork") != "subprocess"
                                   and "PYTHONPATH" not in (env or {}))
    # children are their own gloo world: drop a surrounding torchrun's rendezvous variables
    # (TORCHELASTIC_USE_AGENT_STORE etc. would point their init at the launcher's store)
    child_env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    child_env.update(env or {})
    child_env.setdefault("PYTHONWARNINGS", "ignore")
    child_env.setdefault("OMP_NUM_THREADS", "1")
    for rank in range(world_size):
        out_path = os.path.join(tmp, f"rank{rank}.pkl")
        spec_path = os.path.join(tmp, f"spec{rank}.pkl")
        with open(spec_path, "wb") as f:
            pickle.dump(
                {
                    "rank": rank,
                    "world_size": world_size,
                    "port": port,
                    "target": target,
                    "kwargs": kwargs or {},
                    "out_path": out_path,
                    "sys_path": sys_path or [],
                },
                f,
            )
        if forked:
            log_path = os.path.join(tmp, f"rank{rank}.log")
            if start is not None:
                proc = start(spec_path, log_path, child_env)
            else:
                # not daemonic: a rank may start processes of its own (Megatron's checkpoint writer does)
                proc = _fork_context().Process(target=_forked_worker, args=(spec_path, log_path, child_env))
                proc.start()
            procs.append((proc, log_path))
        else:
            cmd = [sys.executable, "-c", f"from megatron_dmuon.testing.multiproc import _worker_main; _worker_main({spec_path!r})"]
            procs.append(subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs.append(out_path)
    logs = []
    errors = []
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        if forked:
            proc, log_path = p
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                for q, _ in procs:
                    q.kill()
                raise RuntimeError(f"rank {rank} of {target} timed out after {timeout}s")
            with open(log_path, errors="replace") as f:
                logs.append(f.read())
            continue
        try:
            log, _ = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"rank {rank} of {target} timed out after {timeout}s")
        logs.append(log.decode(errors="replace"))
    results = []
    for rank, out_path in enumerate(outs):
        if not os.path.exists(out_path):
            code = procs[rank][0].exitcode if forked else procs[rank].returncode
            errors.append(f"rank {rank}: no result (exit {code})\n{logs[rank][-4000:]}")
            results.append(None)
            continue
        with open(out_path, "rb") as f:
            res = pickle.load(f)
        if not res["ok"]:
            errors.append(f"rank {rank}:\n{res['error']}")
        results.append(res.get("value"))
    if errors:
        raise RuntimeError(f"{target} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
    return results


class ForkedRank:
    """One rank of a later one-rank ``run_distributed``, forked from this process when made: it starts with
    this process's imports, where the fork server (whose first start in a process imports torch and
    megatron-core, ~7 s of CPU) or a fresh interpreter would import them again. For a process that needs a
    single-rank run after it has started a process group of its own (``dmuon-verify`` under torchrun runs its
    reference after training): make it before that process group, CUDA or any thread is started, so the
    fork copies none of them. ``run`` gives it its target (once) and returns what ``run_distributed(target, 1)``
    returns; ``close`` ends it if it never ran (use it as a context manager)."""

    def __init__(self):
        ctx = multiprocessing.get_context("fork")
        self._orders, theirs = ctx.Pipe()
        # not daemonic: a rank may start processes of its own (as _run's forked ranks)
        self._proc = ctx.Process(target=_await_order, args=(theirs, self._orders))
        self._proc.start()
        theirs.close()

    def run(self, target: str, kwargs: Optional[Dict[str, Any]] = None, timeout: float = 600.0,
            sys_path: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None) -> Any:
        if self._orders.closed:
            raise RuntimeError("a ForkedRank runs one target")

        def start(spec_path, log_path, child_env):
            self._orders.send((spec_path, log_path, child_env))
            self._orders.close()
            return self._proc

        return _run_in_tmp(target, 1, kwargs, timeout, sys_path, env, start)[0]

    def close(self) -> None:
        if not self._orders.closed:
            self._orders.close()  # the waiting rank reads the end of its orders and exits
        self._proc.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _await_order(orders, ours) -> None:
    """A ForkedRank: waits for its target (``_forked_worker``'s arguments); exits at once if none comes."""
    ours.close()  # the maker's end: it alone keeps the pipe open, so the maker's exit ends the wait
    try:
        spec_path, log_path, env = orders.recv()
    except EOFError:
        return
    finally:
        orders.close()
    _forked_worker(spec_path, log_path, env)


def run_main_job(argv: List[str], nproc: int = 2, env: Optional[Dict[str, str]] = None,
                 timeout: float = 600.0) -> subprocess.CompletedProcess:
    """The CPU main job (``testing/cpu_train.main(argv)``) on ``nproc`` ranks forked from the fork
    server, as ``torchrun --standalone --nproc-per-node N -m megatron_dmuon.testing.cpu_train`` runs
    it: each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT=0) and its own process; the result is torchrun's:
    returncode 0 when every rank exits 0, else 1, stdout and stderr every rank's in rank order. For
    the tests of what the job does (a test of the launcher itself runs torchrun): it saves each
    run's ~7 s of imports per rank and the launcher's own. ``DMUON_TEST_SPAWN=subprocess`` or an
    ``env`` setting PYTHONPATH runs torchrun instead."""
    return _job(["-m", "megatron_dmuon.testing.cpu_train"], None, argv, nproc, env, timeout)


def run_script_job(script: str, argv: List[str] = (), nproc: int = 2, env: Optional[Dict[str, str]] = None,
                   timeout: float = 600.0) -> subprocess.CompletedProcess:
    """A Python script run as ``torchrun --standalone --nproc-per-node N SCRIPT ARGV`` runs it, on ranks
    forked from the fork server, as ``run_main_job`` runs the main job: each rank runs the file as
    ``__main__`` (its folder first on sys.path, sys.argv = [SCRIPT, *ARGV]) in torchrun's environment;
    torchrun's returncode, every rank's stdout and stderr. ``DMUON_TEST_SPAWN=subprocess`` or an
    ``env`` setting PYTHONPATH runs torchrun instead."""
    return _job([script], script, argv, nproc, env, timeout)


def _job(entry: List[str], script: Optional[str], argv, nproc, env, timeout) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC ENTRY ARGV``, or its ranks forked (``script``: a file
    each rank runs; None: the main job)."""
    argv = list(map(str, argv))
    child_env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    child_env.update(env or {})
    child_env.setdefault("PYTHONWARNINGS", "ignore")
    child_env.setdefault("OMP_NUM_THREADS", "1")
    if os.environ.get("DMUON_TEST_SPAWN", "fork") == "subprocess" or "PYTHONPATH" in (env or {}):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *entry, *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env)
    name = ["main job" if script is None else script] + argv
    port, tmp = free_port(), tempfile.mkdtemp(prefix="dmuon-job-")
    try:
        procs = []
        for rank in range(nproc):
            rank_env = dict(child_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0")
            logs = (os.path.join(tmp, f"rank{rank}.out"), os.path.join(tmp, f"rank{rank}.err"))
            proc = _fork_context().Process(target=_forked_main_job, args=(argv, logs, rank_env, script))
            proc.start()
            procs.append((proc, logs))
        deadline = time.monotonic() + timeout
        for proc, _ in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        if any(proc.is_alive() for proc, _ in procs):
            for proc, _ in procs:
                proc.kill()
                proc.join()
            raise subprocess.TimeoutExpired(name, timeout)
        out, err = [], []
        for _, (out_path, err_path) in procs:
            for path, into in ((out_path, out), (err_path, err)):
                with open(path, errors="replace") as f:
                    into.append(f.read())
        code = 0 if all(proc.exitcode == 0 for proc, _ in procs) else 1
        return subprocess.CompletedProcess(name, code, "".join(out), "".join(err))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                  "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _forked_main_job(argv: List[str], logs: tuple, env: Dict[str, str], script: Optional[str] = None) -> None:
    """One rank of ``run_main_job`` (``run_script_job``: of ``script``): a fresh rank's environment, argv and
    output files, then the job; its exit status is the job's (SystemExit's code; 1 after an uncaught
    exception, printed)."""
    import warnings

    os.environ.clear()
    os.environ.update(env)
    multiprocessing.set_start_method(None, force=True)  # (as in _forked_worker)
    for fd, path in ((1, logs[0]), (2, logs[1])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    _fork_the_checkpoint_writers_manager()
    sys.argv = ["megatron_dmuon.testing.cpu_train" if script is None else script, *argv]
    code = 0
    try:
        if script is None:
            from megatron_dmuon.testing import cpu_train

            cpu_train.main(argv)
        else:  # as `python SCRIPT`: its folder first on the path
            import runpy

            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
