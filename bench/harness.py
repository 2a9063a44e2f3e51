"""The one runner of bench/: the project's main job or Megatron-LM's ``pretrain_gpt.py``, on CPU or GPU.

    from harness import Job, run, in_parallel
    r = run(Job(["--optimizer", "dmuon", "--train-iters", "20"], nproc=2, timing_json=True))
    r["ok"], r["timing"]["summary"]["last_loss"], r["error"]   # (error: the output's tail, when not ok)

A ``Job`` is one launch: ``torchrun --standalone`` with ``nproc`` ranks (CPU: gloo; GPU: one rank per
GPU), or ``launch="single"``: one process with its own rendezvous port (one GPU without torchrun, so
that several runs share it). ``run`` returns a dict: ``ok``, ``returncode``, ``output`` (stdout then
stderr), ``stdout``, ``timing`` (the main job's ``--timing-json`` document, read back: ``summary``,
``iterations``, ``validation``), ``wall_s``, ``attempts`` and, when not ok, ``error`` (the output's
last ``TAIL_CHARS`` characters). A run that failed on something transient (out of memory,
EADDRINUSE: another run on the same machine took it) is tried once more after ``retry_wait_s``.
``in_parallel`` runs a function over items ``jobs`` at a time (a ``--jobs`` pool; seeds are items).

The main job is named here once (``main_job()``: ``python -m megatron_dmuon.megatron.train`` on GPUs, the
same trainer through the CPU shim on CPUs); the layer and precision flags the main-job benchmarks
pass it (``add_layer_args`` / ``job_layer_args`` / ``layers_of``) live here too. From a shell script:

    python bench/harness.py [--nproc N | --single] -- <main-job flags>     # output streams through
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # (the repository, for the package)
# The project's main job, as ``python``'s argv: the trainer's own entry on CUDA GPUs; on CPUs the same trainer
# after the test CPU shim (megatron-core's hard-coded CUDA calls need it). launch/precheck.py picks the same
# way for launch/run_main.sh. The one place in bench/ that names it: ``main_job()``.
MAIN_JOB_GPU = ["-m", "megatron_dmuon.megatron.train"]
MAIN_JOB_CPU = ["-m", "megatron_dmuon.testing.cpu_train"]
TRANSIENT = ("out of memory", "EADDRINUSE")  # failures a second attempt may not meet
TAIL_CHARS = 3000
# NVLink multicast off (NCCL NVLS, symmetric memory), as the GPU drivers here (*.sh) set it; harmless elsewhere
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass
class Job:
    """One launch of ``program`` (default: the main job) with ``flags``."""
    flags: list
    program: list = dataclasses.field(default_factory=lambda: main_job())
    nproc: int = 1
    launch: str = "torchrun"          # or "single": one process, RANK 0 of 1, its own MASTER_PORT
    timing_json: str | bool | None = None  # a path (True: a temporary file) passed as --timing-json, read back
    reuse: bool = False               # a timing_json that exists already is read back without running
    env: dict = dataclasses.field(default_factory=dict)  # on top of os.environ
    cwd: str | None = None
    timeout: float | None = None      # seconds; then SIGTERM (torchrun passes it to its ranks), SIGKILL 30 s later
    retries: int = 1                  # further attempts after a transient failure
    retry_wait_s: float = 30.0
    log: str | None = None            # the whole output written here
    show: bool = False                # print the command line first ("$ ...")


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main_job(gpu: bool | None = None) -> list:
    """The main job's ``python`` argv: ``MAIN_JOB_GPU`` where CUDA is (``gpu=None``: this machine), else ``MAIN_JOB_CPU``."""
    return list(MAIN_JOB_GPU if (has_cuda() if gpu is None else gpu) else MAIN_JOB_CPU)


def launch_for(nproc: int, gpu: bool) -> str:
    """One GPU, one rank: a plain process (runs sharing a GPU need no torchrun each); else torchrun."""
    return "single" if gpu and nproc == 1 else "torchrun"


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(job: Job, timing_path: str | None = None) -> list:
    tail = [*job.flags, *(["--timing-json", timing_path] if timing_path else [])]
    if job.launch == "single":
        return [sys.executable, *job.program, *tail]
    if job.launch != "torchrun":
        raise ValueError(f"Job.launch: 'torchrun' or 'single', not {job.launch!r}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job.nproc),
            *job.program, *tail]


def _single_env() -> dict:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def _attempt(cmd: list, env: dict, cwd, timeout, capture: bool) -> tuple:
    """(returncode, or None when it timed out; stdout; stderr). A run past ``timeout`` gets SIGTERM (torchrun
    passes it to its ranks), then SIGKILL 30 s later. The run stays in this process group, so Ctrl-C reaches it."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out or "", err or ""
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return None, out or "", (err or "") + f"\n[harness] stopped after {timeout} s (--timeout)\n"
    finally:
        if proc.poll() is None:  # interrupted while it ran
            proc.kill()
            proc.wait()


def read_timing(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def run(job: Job, capture: bool = True) -> dict:
    """Run ``job`` (see the module's docstring for the result); ``capture=False`` lets the output through."""
    timing = job.timing_json
    if timing is True:
        fd, timing = tempfile.mkstemp(suffix=".json", prefix="harness_timing_")
        os.close(fd)
        os.unlink(timing)  # the job writes it; its presence says the job finished
    if timing and job.reuse and os.path.exists(timing):
        return {"ok": True, "returncode": 0, "output": "", "stdout": "", "timing": read_timing(timing), "wall_s": 0.0,
                "attempts": 0, "reused": True}
    env = dict(os.environ, **job.env)
    cmd = command(job, timing or None)
    start = time.time()
    for attempt in range(1 + max(0, job.retries)):
        if job.launch == "single":
            env.update(_single_env())  # a new port for every attempt
        if job.show:
            print("$", " ".join(cmd), flush=True)
        rc, out, err = _attempt(cmd, env, job.cwd, job.timeout, capture)
        transient = rc not in (0, None) and any(t in out + err for t in TRANSIENT)
        if not transient or attempt == job.retries:
            break
        time.sleep(job.retry_wait_s)
    output = out + err
    if job.log:
        with open(job.log, "w") as f:
            f.write(output)
    result = {"ok": rc == 0, "returncode": rc, "output": output, "stdout": out, "timing": None,
              "wall_s": time.time() - start, "attempts": attempt + 1, "command": cmd}
    if timing:
        if os.path.exists(timing):
            result["timing"] = read_timing(timing)
            if job.timing_json is True:  # a temporary file: the result holds it now
                os.unlink(timing)
        else:
            result["ok"] = False
    if not result["ok"]:
        result["error"] = output[-TAIL_CHARS:]
    return result


def in_parallel(fn, items, jobs: int = 1, on_done=None, deadline: float | None = None, not_started=None) -> list:
    """``[fn(item) for item in items]``, ``jobs`` calls at a time, results in the order of ``items``.
    ``on_done(item, result)`` as each finishes (in this thread). Past ``deadline`` (time.time()) no
    further call starts: its result is ``not_started(item)``."""
    results = [None] * len(items)
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        pending = {}

        def finish(done):
            for fut in done:
                i = pending.pop(fut)
                results[i] = fut.result()
                if on_done:
                    on_done(items[i], results[i])

        for i, item in enumerate(items):
            if deadline is not None and time.time() > deadline:
                results[i] = not_started(item)
                if on_done:
                    on_done(item, results[i])
                continue
            pending[pool.submit(fn, item)] = i
            while len(pending) >= max(1, jobs):  # a slot frees before the next start (and its deadline check)
                finish(concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)[0])
        while pending:
            finish(concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)[0])
    return results


def progress_tail(output: str, lines: int = 12) -> str:
    """The main job's progress lines, its summary and any traceback: the last ``lines`` of them."""
    keep = [l for l in output.splitlines()
            if l.startswith((" iteration", ">", "Traceback", "  File")) or "Error" in l]
    return "\n".join(keep[-lines:])


def main_job_module(gpu: bool | None = None):
    """The main job as a module in this process (its ``main(argv)``), for benchmarks that watch it from inside."""
    import importlib

    name = main_job(gpu)[1]
    module = importlib.import_module(name)
    return module if hasattr(module, "main") else importlib.import_module(name + ".__main__")  # (a package)


# --- the main job's layer and precision flags (Megatron-LM's names; the job's defaults: TE where it imports on a GPU)

def add_layer_args(p) -> None:
    from megatron_dmuon.megatron.gpt import FP8_FORMATS, FP8_RECIPES, TRANSFORMER_IMPLS

    p.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default=None,
                   help="the main job's layers (default: TE where transformer_engine imports on a GPU, else local)")
    p.add_argument("--fp8-format", choices=FP8_FORMATS, default=None, help="FP8 GEMMs through TE")
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None)
    p.add_argument("--fp8-param-gather", action="store_true", help="TE FP8 params")


def job_layer_args(args) -> list:
    """The flags of ``add_layer_args`` as the main job takes them (only those given)."""
    out = []
    if args.transformer_impl:
        out += ["--transformer-impl", args.transformer_impl]
    if args.fp8_format:
        out += ["--fp8-format", args.fp8_format]
    if args.fp8_recipe:
        out += ["--fp8-recipe", args.fp8_recipe]
    if args.fp8_param_gather:
        out.append("--fp8-param-gather")
    return out


def layers_of(summary: dict) -> str:
    """What a finished run ran, from its summary: 'TE', 'TE fp8 hybrid/delayed', 'local' ..."""
    impl = summary.get("transformer_impl")
    text = {"transformer_engine": "TE", "local": "local"}.get(impl, "local (before TE)" if impl is None else impl)
    fp8 = summary.get("fp8")
    if fp8:
        text += f" fp8 {fp8['format']}/{fp8['recipe']}" + (" fp8-params" if fp8.get("param_gather") else "")
    return text


def main(argv=None) -> int:
    from cli_inputs import OneLineParser  # (bench/, on the path when this runs as a script)

    p = OneLineParser(description="Run the main job once (output streams through); exit with its status.")
    p.add_argument("--nproc", type=int, default=1, help="ranks under torchrun")
    p.add_argument("--single", action="store_true", help="one process with its own rendezvous port, no torchrun")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the main job's flags")
    args = p.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    result = run(Job(flags, nproc=args.nproc, launch="single" if args.single else "torchrun", retries=0), capture=False)
    return result["returncode"] if result["returncode"] is not None else 124


if __name__ == "__main__":
    sys.exit(main())
