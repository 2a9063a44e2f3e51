"""No child process of a rank outlives it (Linux).

A rank's first checkpoint save starts processes: megatron-core's torch_dist writer keeps its write
results in a ``multiprocessing`` Manager queue (``dist_checkpointing.strategies.filesystem_async.
get_write_results_queue``: a spawned server process, which also starts multiprocessing's resource
tracker), and Megatron-LM's ``--async-save`` forks or spawns a writer. They inherit the rank's stdout
and stderr. A rank that ends normally shuts them down (multiprocessing's exit handlers); a rank that
is SIGKILLed (the OOM killer, a lost node, --fail-at-iteration) cannot, and torchrun only signals
the process groups of ranks still alive. The Manager lived on, and with it the resource tracker it
holds open, and both held the job's stderr pipe: ``torchrun ... | tee`` and launch/run_main.sh never
ended ([bad-input-4]).

``install()`` (called before a save: ``checkpoint.save_checkpoint``, and by the Megatron-LM hook)
makes every multiprocessing child this process starts from then on die with it:

* spawned and forkserver children (``multiprocessing.util.spawnv_passfds``: a fresh ``python -c
  PROG``): PROG first sets ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, then exits at once if this process
  is already gone (it died between the fork and the prctl);
* forked children (``os.fork``: the fork start method, ``--async-save``'s writer): the same, right
  after the fork (``os.register_at_fork``).

PR_SET_PDEATHSIG fires when the *thread* that started the child ends, so a child started by a thread
other than the main one watches its parent's pid instead (a daemon thread, every 0.5 s). The
resource tracker is left as it is: it ends by itself once every process holding its pipe is gone
(this process and the children above), after unlinking what they leaked.

``die_with_torchrun()`` (called first by the main job's ranks and by the Megatron-LM hook) is the
same guard one level up: torchrun starts every rank in a session of its own and signals them only
while it lives, so a SIGKILLed torchrun (``kill -KILL``, the OOM killer) left its ranks training and
writing checkpoints under pid 1 ([bad-input-5]). A rank under torchrun watches its parent's pid and
exits within half a second of torchrun's end; its own children follow through ``install()``.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

PR_SET_PDEATHSIG = 1
SIGKILL = 9
_TRACKER = "from multiprocessing.resource_tracker import"
_installed = False
_main_ident = None
_fork_parent = [0]  # the pid that forked, set in the parent just before each fork


def _prelude(parent: int, main_thread: bool) -> str:
    """Python source that makes the process it runs in die with ``parent``."""
    if main_thread:
        return (f"import ctypes as _c,os as _o;_c.CDLL(None).prctl({PR_SET_PDEATHSIG},{SIGKILL},0,0,0);"
                f"_o.getppid()=={parent} or _o._exit(1)\n")
    return ("import os as _o,threading as _t,time as _s\n"
            f"def _w(p={parent}):\n while _o.getppid()==p:_s.sleep(0.5)\n _o._exit(1)\n"
            "_t.Thread(target=_w,daemon=True).start()\n")


def guard_args(args, parent: int, main_thread: bool) -> list:
    """``args`` of a ``python ... -c PROG ...`` child with PROG made to die with ``parent``
    (unchanged: no ``-c``, or the resource tracker)."""
    args = list(args)
    if "-c" in args[:-1]:
        i = args.index("-c") + 1
        if not args[i].startswith(_TRACKER):
            args[i] = _prelude(parent, main_thread) + args[i]
    return args


def die_with_parent(parent: int, main_thread: bool = True) -> None:
    """In a child: end when ``parent`` ends (see the module's doc); exit now if it already has."""
    if main_thread and sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    if not main_thread:
        def watch():
            import time

            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


# what torchrun's agent sets in every worker's environment (and nothing else sets)
TORCHRUN_WORKER_ENV = "TORCHELASTIC_RUN_ID"


def die_with_torchrun() -> None:
    """Under torchrun: this process (a rank) ends when torchrun does; elsewhere a no-op. Idempotent.
    A watcher thread, not PR_SET_PDEATHSIG: that fires when the torchrun *thread* that started the
    rank ends, and nothing promises that torchrun starts its ranks from its main thread."""
    global _watching_torchrun
    if _watching_torchrun or TORCHRUN_WORKER_ENV not in os.environ:
        return
    _watching_torchrun = True
    die_with_parent(os.getppid(), main_thread=False)


_watching_torchrun = False


def _before_fork() -> None:
    _fork_parent[0] = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_fork_parent[0], threading.get_ident() == _main_ident)


def install() -> None:
    """From now on every multiprocessing child of this process dies with it (Linux; elsewhere a no-op).
    Idempotent."""
    global _installed, _main_ident
    if _installed or not sys.platform.startswith("linux"):
        return
    import multiprocessing.util as mp_util

    original = mp_util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):
        return original(path, guard_args(args, os.getpid(), threading.current_thread() is threading.main_thread()),
                        passfds)

    spawnv_passfds.__wrapped__ = original
    mp_util.spawnv_passfds = spawnv_passfds
    _main_ident = threading.main_thread().ident
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _installed = True
