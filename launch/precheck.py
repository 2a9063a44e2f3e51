"""launch/run_main.sh's check before torchrun, in one Python process (torch imported once):

* picks the entry: on CUDA GPUs ``megatron_dmuon.megatron.train`` with ``--bf16``, one rank per GPU;
  elsewhere ``megatron_dmuon.testing.cpu_train``, 2 ranks (``NPROC`` overrides the count);
* bounds the rank count on this one host (``NPROC``): one rank per GPU on CUDA (a rank takes the GPU
  of its LOCAL_RANK); on CPUs at most ``RANKS_PER_CORE`` per core and ``RANK_BYTES`` of memory each
  (NPROC=1000 on 2 cores was checked, planned and started, [bad-input-5]);
* checks the job's arguments as every rank will (the trainer's ``parse_args``, what ``--parse-only``
  runs; WORLD_SIZE as under torchrun): a usage error prints one message and exits 2 (under torchrun
  every rank would print it, and torchrun add its report);
* prints the choice as its only stdout line, ``run: NPROC ENTRY [EXTRA...]``.

``-h`` / ``--help`` prints the help (stdout, exit 0) and no ``run:`` line: run_main.sh then stops.
The CPU entry's shim (megatron-core's CUDA calls on the CPU, for building and training) is not
needed to check arguments and is not imported here (4-5 s of megatron-core imports saved).
"""
import os
import sys

RANKS_PER_CORE = 4  # CPU ranks (gloo) oversubscribed past this mostly wait for each other
RANK_BYTES = 400 << 20  # what one CPU rank holds before its model: Python, torch, megatron-core (measured 430 MB)


def _error(message: str) -> None:
    sys.stderr.write(f"run_main.sh: error: {message}\n")
    sys.exit(2)


def _rank_bound_problem(nproc: int, cuda: bool, gpus: int):
    """Why this host cannot run ``nproc`` ranks (None: it can)."""
    if cuda:
        if nproc > gpus:
            return f"NPROC={nproc} ranks on this host, which has {gpus} GPU(s): one rank per GPU; lower NPROC, or " \
                   "run across hosts (launch/slurm)"
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc > RANKS_PER_CORE * cores:
        return f"NPROC={nproc} CPU ranks on {cores} core(s): at most {RANKS_PER_CORE} per core ({RANKS_PER_CORE * cores}); " \
               "lower NPROC"
    try:
        import psutil

        available = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001 - no bound rather than a wrong one
        return None
    if nproc * RANK_BYTES > available:
        return f"NPROC={nproc} CPU ranks need at least {nproc * RANK_BYTES / 2**30:.1f} GiB ({RANK_BYTES >> 20} MiB each " \
               f"before the model), more than the {available / 2**30:.1f} GiB available: lower NPROC"
    return None


def main() -> None:
    import torch

    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    nproc = os.environ.get("NPROC") or str(gpus if cuda else 2)
    if not (nproc.isdigit() and int(nproc) >= 1):
        _error(f"NPROC (the number of ranks) must be a whole number >= 1 (got {nproc!r}); "
               "unset it for " + ("one rank per GPU" if cuda else "2 CPU ranks"))
    problem = _rank_bound_problem(int(nproc), cuda, gpus)
    if problem:  # before anything is checked or planned for that many ranks
        _error(problem)
    nproc = str(int(nproc))  # (NPROC=0002: torchrun's 2)
    entry, extra = ("megatron_dmuon.megatron.train", ["--bf16"]) if cuda else ("megatron_dmuon.testing.cpu_train", [])
    os.environ.update(WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc)
    from megatron_dmuon.megatron.train.args import parse_args

    parse_args([*extra, *sys.argv[1:]])  # -h: the help, exit 0 before the line below
    print("run:", nproc, entry, *extra, flush=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while checking: no traceback
        sys.exit(130)
