"""The job's --save / --load: one writer per --save directory (a lock), resume from the latest
checkpoint, save one (Megatron-LM's torch_dist layout, through megatron/checkpoint/job.py)."""
from __future__ import annotations

import errno
import logging
import os

import torch

from .checks import model_config_of
from .run_errors import job_error


class SaveLock:
    """An exclusive lock on ``DIR/.dmuon_save.lock`` held by rank 0 for the run (released by the
    kernel when the process dies, so a torchrun restart takes it again). The file names its holder."""

    NAME = ".dmuon_save.lock"

    def __init__(self, directory: str):
        self.path = os.path.join(directory, self.NAME)
        self.handle = None

    def acquire(self):
        """None when taken, else who holds it."""
        import fcntl
        import socket

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            return holder
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
        self.handle = handle
        return None


_SAVE_LOCKS = {}  # held until the process ends


def hold_save_lock(args, rank) -> None:
    """One writer per --save directory: rank 0 takes the lock for the run, or every rank stops."""
    if not args.save:
        return
    holder = [_SAVE_LOCKS.setdefault(args.save, SaveLock(args.save)).acquire() if rank == 0 else None]
    torch.distributed.broadcast_object_list(holder, src=0)
    if holder[0]:
        job_error(f"--save {args.save} is being written by another run ({holder[0]}, "
                  f"{os.path.join(args.save, SaveLock.NAME)}): wait for it, or save elsewhere", 2)


def load_if_requested(args, ddp, opt, sched, rank) -> tuple[int, int]:
    """Resume from --load's latest checkpoint: (the iteration to continue after, the samples consumed
    by then); (0, 0): a fresh start. As Megatron-LM's load_checkpoint: --no-load-optim loads the model
    and keeps the iteration and consumed samples (the data continues), while the optimizer state and
    the lr schedule start fresh (Megatron loads the schedule with the optimizer state)."""
    from megatron_dmuon.megatron.checkpoint.job import checkpoint_dir, latest_iteration, load_checkpoint

    if not args.load:
        return 0, 0
    iteration = latest_iteration(args.load)
    if iteration is None:
        if rank == 0:
            print(f"> no checkpoint in {args.load}: starting from scratch", flush=True)
        return 0, 0
    from megatron_dmuon.megatron.checkpoint import CheckpointMismatchError

    try:  # (the optimizer record is checked on every rank before anything is read: all ranks stop here together)
        common = load_checkpoint(checkpoint_dir(args.load, iteration), [ddp], opt,
                                 load_optimizer=not args.no_load_optim)
    except CheckpointMismatchError as e:
        job_error(f"--load {args.load}: {e}", 2)
    if not args.no_load_optim:
        sched.load_state_dict(common["opt_param_scheduler"])
    iteration = int(common["iteration"])
    consumed = consumed_samples_of(common, iteration, args.global_batch_size)
    if rank == 0:
        print(f"> loaded checkpoint {checkpoint_dir(args.load, iteration)} at iteration {iteration}, "
              f"{consumed} consumed samples" + (" (model only: --no-load-optim; optimizer state and lr schedule "
                                                  "start fresh)" if args.no_load_optim else ""), flush=True)
    if hasattr(ddp, "dmuon_plan"):
        from megatron_dmuon.megatron.replicas import check_replicas

        report = check_replicas([ddp])
        if rank == 0:
            print(f"> {report}", flush=True)
        if not report.ok:
            raise RuntimeError(f"after loading {args.load}: {report}")
    return iteration, consumed


def consumed_samples_of(common: dict, iteration: int, global_batch_size: int) -> int:
    """The train samples a checkpoint's run had consumed (Megatron-LM keeps them in the checkpoint's args).
    A checkpoint written before the job recorded them: its scheduler's sample count (the same unless
    steps were skipped), else iteration x --global-batch-size (Megatron-LM's fallback)."""
    consumed = common.get("consumed_samples")
    if isinstance(consumed, int) and consumed >= 0:
        return consumed
    sched = common.get("opt_param_scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("num_steps"), int):
        return sched["num_steps"]
    return iteration * global_batch_size


# what torch's writers say when the disk is full (its zip writer: "unexpected pos"; the OS: ENOSPC)
DISK_FULL_SIGNS = ("No space left on device", "unexpected pos", "file write failed")
NEARLY_FULL_BYTES = 1 << 20  # less free space than this after a failed write: the disk is full
WRITER_LOGGER = "megatron.core.dist_checkpointing"


class _WriterErrors(logging.Handler):
    """The error lines megatron-core's checkpoint writers log: its async file writer logs a worker's
    OSError and raises only ``Worker failure: ... <class 'RuntimeError'>`` (a full disk was never named)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _exception_texts(e: BaseException) -> list:
    """``type: message`` of ``e``, of the failures a torch DCP CheckpointException wraps, and of their
    causes: (text, errno, whether it wraps failures) triples."""
    out, todo, seen = [], [e], set()
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        failures = getattr(exc, "failures", None)
        out.append((f"{type(exc).__name__}: {exc}", getattr(exc, "errno", None), isinstance(failures, dict)))
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [exc.__cause__, exc.__context__]
    return out


def _free_bytes(directory: str):
    try:
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize
    except OSError:
        return None


def save_failure_reason(e: BaseException, logged: list, directory: str) -> tuple:
    """(one line saying why a save failed, whether the disk is full): the exception, what it wraps and
    what the writers logged; a disk left with less than ``NEARLY_FULL_BYTES`` free is full whatever
    the writer said."""
    texts = _exception_texts(e)
    said = [t for t, _, _ in texts] + list(logged)
    free = _free_bytes(directory)
    full = any(sign in t for sign in DISK_FULL_SIGNS for t in said) or any(n == errno.ENOSPC for _, n, _ in texts) \
        or (free is not None and free < NEARLY_FULL_BYTES)
    if full:
        return "no space left on device: the disk holding it is full", True
    # what failed: a writer's logged error, else the first exception that wraps no other (DCP's own
    # CheckpointException lists every rank's traceback)
    detail = next(iter(logged), None) or next((t for t, _, wraps in texts if not wraps), said[0])
    return " ".join(detail.split())[:300], False


def save(args, iteration, ddp, opt, sched, rank, consumed: int = None) -> None:
    """Checkpoint ``iteration`` into --save, with the train samples consumed by then (as Megatron-LM's
    checkpoint args hold them: a resume, even with --no-load-optim, continues the data there)."""
    from megatron_dmuon.megatron.checkpoint.job import latest_iteration, save_checkpoint

    extra = {"opt_param_scheduler": sched.state_dict(), "model_config": model_config_of(args)}
    if consumed is not None:
        extra["consumed_samples"] = int(consumed)
    writer_errors = _WriterErrors()
    logging.getLogger(WRITER_LOGGER).addHandler(writer_errors)
    try:
        path = save_checkpoint(args.save, iteration, [ddp], opt, extra=extra)
    except BaseException as e:  # torch DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        reason, full = save_failure_reason(e, writer_errors.lines, args.save)
        latest = latest_iteration(args.save)
        kept = f"iteration {latest} is still the latest complete checkpoint there" if latest is not None else \
            "no earlier checkpoint is there"
        job_error(f"--save {args.save}: writing the checkpoint of iteration {iteration} failed ({reason}); {kept} "
                  "(the tracker was not moved)" + ("; free space there, or save elsewhere" if full else ""), 1)
    finally:
        logging.getLogger(WRITER_LOGGER).removeHandler(writer_errors)
    if rank == 0:
        print(f"> saved checkpoint {path}", flush=True)
