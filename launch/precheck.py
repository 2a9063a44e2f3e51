"""launch/run_main.sh's check before torchrun, in one Python process (torch imported once):

* picks the entry: on CUDA GPUs ``megatron_dmuon.megatron.train`` with ``--bf16``, one rank per GPU;
  elsewhere ``megatron_dmuon.testing.cpu_train``, 2 ranks (``NPROC`` overrides the count);
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


def main() -> None:
    import torch

    cuda = torch.cuda.is_available()
    nproc = os.environ.get("NPROC") or str(torch.cuda.device_count() if cuda else 2)
    if not (nproc.isdigit() and int(nproc) >= 1):
        sys.stderr.write(f"run_main.sh: error: NPROC (the number of ranks) must be a whole number >= 1 (got {nproc!r}); "
                         "unset it for " + ("one rank per GPU" if cuda else "2 CPU ranks") + "\n")
        sys.exit(2)
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
