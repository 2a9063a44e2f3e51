"""Where the main job writes: every output path checked, before anything runs, against what the job
reads (the data, the checkpoints --load reads), against the other outputs, and against files the job
did not write; each directory and file it will write probed by really creating one (``os.access``
says yes to root on read-only and virtual file systems). Used by the start-up checks (checks.py);
errors through the job's parser (``p.error``: exit 2, rank 0 prints)."""
from __future__ import annotations

import os
import re

from .data import stdlib_files


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _write_problem(folder: str, make_dir: bool):
    """Try what a run will do in ``folder``: create a directory holding a file (``make_dir``) or a
    file, write a byte, and remove it again. The OS's reason it cannot, or None. (os.access says
    yes to root on read-only or virtual file systems, /sys or /proc: the run then failed at its
    first write, on every rank.)"""
    import tempfile

    made = None
    try:
        if make_dir:
            made = tempfile.mkdtemp(prefix=".dmuon_write_check_", dir=folder)
            name = os.path.join(made, "probe")
            fd = os.open(name, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        else:
            fd, name = tempfile.mkstemp(prefix=".dmuon_write_check_", dir=folder)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
        os.remove(name)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        if made:
            try:
                for leftover in os.listdir(made):
                    os.remove(os.path.join(made, leftover))
                os.rmdir(made)
            except OSError:
                pass
    return None


def dir_problem(path: str):
    """Why ``path`` cannot be (made) a writable directory, or None (tried: a file written and removed)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a directory"
        why = _write_problem(path, make_dir=False)
        return f"is not writable ({why})" if why else None
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        return f"cannot be created: {base} is not a directory"
    why = _write_problem(base, make_dir=True)
    return f"cannot be created: {base} does not take a new directory ({why})" if why else None


def file_problem(path):
    """Why a file cannot be written at ``path`` (its folder must exist), or None (tried)."""
    import stat

    if not path:
        return None
    if os.path.isdir(path):
        return "is a directory"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"its folder {folder} does not exist"
    if os.path.exists(path):
        mode = os.stat(path).st_mode
        if stat.S_ISBLK(mode):
            return "is a block device (a disk): writing it would destroy what it holds"
        if not stat.S_ISREG(mode):  # a character device (/dev/null) or a FIFO: written as it is
            return None if os.access(path, os.W_OK) else "is not writable"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))  # (opened, not changed)
        except OSError as e:
            return f"is not writable ({e.strerror or e})"
        return None
    why = _write_problem(folder, make_dir=False)
    return f"its folder {folder} does not take a new file ({why})" if why else None


# what a --save / --load directory holds of the job's: the tracker, the lock file, iter_NNNNNNN/**
_ITER_DIR = re.compile(r"iter_\d{7}")
_LOCK_NAME = ".dmuon_save.lock"


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def _same_file(a: str, b: str) -> bool:
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)  # (hard links)
    except OSError:
        return False


def _checkpoint_entry(root: str, path: str):
    """The entry of checkpoint directory ``root`` that ``path`` is or lies in (the tracker, the lock
    file or an iter_NNNNNNN directory), or None."""
    from megatron_dmuon.megatron.checkpoint.job import TRACKER

    rel = os.path.relpath(_real(path), _real(root))
    first = rel.split(os.sep)[0]
    if rel == "." or first == "..":
        return None
    return first if first in (TRACKER, _LOCK_NAME) or _ITER_DIR.fullmatch(first) else None


def _output_files(args) -> list:
    """(name, path) of every file the run writes outside --save: --timing-json, --profile-out and, under
    --optimizer dmuon, DMuon's caches."""
    out = [(flag, path) for flag, path in (("--timing-json", args.timing_json), ("--profile-out", args.profile_out))
           if path]
    if args.optimizer == "dmuon":
        from megatron_dmuon.kernels.autotune import AutotuneCache
        from megatron_dmuon.planning.caches import (PlanCache, ProfileCache, default_plan_cache_path,
                                                    default_profile_cache_path)

        for cache in (AutotuneCache(args.dmuon_autotune_cache), PlanCache(default_plan_cache_path()),
                      ProfileCache(default_profile_cache_path())):
            out.append((f"the {cache.label} {cache.env}", str(cache.path)))
    return out


def check_outputs_against_inputs(p, args) -> None:
    """Nothing the run writes may be something it reads, or a file it did not write: every output
    (--timing-json, --profile-out, DMuon's caches, the checkpoints --save writes) against every input
    (--data-path's .bin and .idx, the default data's files, the checkpoints --load reads) and against
    each other; an existing --timing-json / --profile-out must be one this job wrote."""
    outputs = _output_files(args)
    for i, (flag, path) in enumerate(outputs):
        for other, other_path in outputs[i + 1:]:
            if _same_file(path, other_path):
                p.error(f"{flag} and {other} name the same file {path}: each would overwrite the other; give "
                        "them different paths")
    inputs = [("--data-path", args.data_path + ext) for ext in (".bin", ".idx")] if args.data_path else []
    for flag, path in outputs:
        for source, data in inputs:
            if _same_file(path, data):
                p.error(f"{flag} {path} is the dataset {data} that --data-path {args.data_path} reads: writing it "
                        f"would destroy the data; name another file for {flag}")
        for source, root in (("--load", args.load), ("--save", args.save)):
            entry = root and _checkpoint_entry(root, path)
            if entry:
                p.error(f"{flag} {path} lies in {os.path.join(root, entry)}, where {source} "
                        f"{'reads' if source == '--load' else 'writes'} checkpoints: name a file outside the "
                        "tracker and the iter_NNNNNNN directories")
    if not args.data_path:
        for flag, path in outputs:
            real = _real(path)
            if real.endswith(".py") and os.path.exists(real) and real in {_real(f) for f in stdlib_files()}:
                p.error(f"{flag} {path} is a file of the default data (the Python standard library's source): "
                        "name another file")
    if args.save:
        for source, data in inputs:
            if _checkpoint_entry(args.save, data):
                p.error(f"--save {args.save} would write over {data}, which --data-path reads: save elsewhere")
        if args.load and _real(args.load) != _real(args.save):
            if _checkpoint_entry(args.load, args.save):
                p.error(f"--save {args.save} lies inside {args.load}'s checkpoints, which --load reads: save "
                        f"elsewhere, or --save {args.load} to continue there")
            if _checkpoint_entry(args.save, args.load):
                p.error(f"--load {args.load} lies where --save {args.save} writes its checkpoints: pass --load "
                        f"{args.save}, or save elsewhere")
    from .summary import is_timing_json

    for flag, path, ours, what in (("--timing-json", args.timing_json, is_timing_json, "a timing JSON"),
                                   ("--profile-out", args.profile_out, is_profile_trace, "a profile trace")):
        if path and os.path.isfile(path) and os.path.getsize(path) and not ours(path):
            p.error(f"{flag} {path} exists and is not {what} this job wrote: it would be overwritten; name a new "
                    "file, or remove it first")


def is_profile_trace(path: str) -> bool:
    """Whether ``path`` begins as torch.profiler's Chrome trace does (Profile writes --profile-out so):
    a JSON object with "schemaVersion" first and "traceEvents" (after the device properties)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return head.lstrip().startswith(b'{') and b'"schemaVersion"' in head[:200] and b'"traceEvents"' in head
