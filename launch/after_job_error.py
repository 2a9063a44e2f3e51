"""launch/run_main.sh's runner of torchrun: ``python after_job_error.py torchrun ARGS...`` runs the
command with its stdout as is and its stderr through this filter, and exits with its status.

The filter passes every stderr line through until the job's own run-time error (``dmuon-train:
error: ...``, printed once by rank 0 as every rank stops), then drops what follows: torchrun's report
of the children that exited non-zero, which repeats the failure as a traceback. A crash without the
job's error line (a segfault, an unexpected exception) keeps torchrun's report.

It ends when the command ends, whatever the command's children do: a process a rank started (a
checkpoint writer) inherits the stderr pipe, and one that outlived a SIGKILLed rank kept the pipe
open, so waiting for its end of file hung the launcher forever ([bad-input-4]). Once the command has
exited, what is already in the pipe is passed on and the filter exits.

Signals sent to the runner reach the job, once each: torchrun runs in a process group of its own
(so a terminal's Ctrl-C, which signals the foreground group, reaches the filter only, not torchrun a
second time) and the filter passes SIGINT, SIGTERM, SIGHUP and SIGQUIT on to it; ``kill -INT`` of
run_main.sh's pid (the filter, after its exec) was ignored before ([bad-input-5]). torchrun stops the
ranks; the filter drops what follows (every rank's KeyboardInterrupt traceback, torchrun's
SignalException traceback), says in one line what it saw (the signal, torchrun's status, whether every
process of the job had closed its output) and exits 128 + the signal (130 for Ctrl-C). torchrun also
dies with the filter (PR_SET_PDEATHSIG: SIGTERM), so a SIGKILLed run_main.sh stops the job too. A
closed stderr (``run_main.sh 2>&1 | head``) is not an error: the rest is read and dropped, the status
is the job's.
"""
import os
import select
import signal
import subprocess
import sys
import time

MARK = b"dmuon-train: error:"
DRAIN_S = 2.0  # after the command ended: pass on what its children still write for at most this long


class Filter:
    def __init__(self, out_fd: int):
        self.out_fd = out_fd
        self.seen = False  # the job's error line has been written: drop the rest
        self.interrupted = False  # a signal was passed on to the command: drop the rest (its tracebacks)
        self.broken = False  # our stderr is closed: read on, write nothing
        self.pending = b""

    def feed(self, data: bytes) -> None:
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            self._line(line + b"\n")

    def close(self) -> None:
        if self.pending:
            self._line(self.pending)
            self.pending = b""

    def _line(self, line: bytes) -> None:
        if self.seen or self.broken or self.interrupted:
            return
        self.seen = line.startswith(MARK)
        self.write(line)

    def write(self, line: bytes) -> None:
        try:
            while line:
                line = line[os.write(self.out_fd, line):]
        except OSError:  # BrokenPipeError: nobody reads our stderr any more
            self.broken = True


PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _start(cmd):
    """``cmd`` with its stderr piped here, in a process group of its own, ending with this process."""
    parent = os.getpid()

    def in_child():
        os.setpgid(0, 0)
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the filter died before the prctl
                os._exit(1)

    return subprocess.Popen(cmd, stderr=subprocess.PIPE, preexec_fn=in_child)


def _signal_line(name: str, signum: int, code: int, all_closed: bool) -> str:
    """What the filter saw of a job it passed ``signum`` on to (nothing it did not see)."""
    sig = signal.Signals(signum).name
    what = f"{'interrupted' if signum == signal.SIGINT else 'stopped'}: {sig} passed on to {name}"
    if code == 0:
        return f"{what}, which exited with 0 nonetheless\n"
    ends = "and every process of the job has closed its output" if all_closed else \
        "but a process of the job still holds its output open"
    return f"{what}; the job was stopped before its end: {name} exited with {code}, {ends}\n"


def run(cmd) -> int:
    filt = Filter(sys.stderr.fileno())
    name = os.path.basename(cmd[0])
    started = []  # the command's Popen, once started
    passed = []  # the signals passed on to the running command

    def pass_on(signum, _):
        if started and started[0].returncode is not None:
            return  # the command has ended: what is left is its output, not a job to stop
        passed.append(signum)
        filt.interrupted = True  # what follows (the tracebacks of the stop) is dropped
        if started:
            os.kill(started[0].pid, signum)

    for signum in PASSED_ON:
        signal.signal(signum, pass_on)
    try:
        proc = _start(cmd)
    except OSError as e:
        filt.write(f"{os.path.basename(__file__)}: cannot run {cmd[0]}: {e.strerror}\n".encode())
        return 127
    started.append(proc)
    if passed:  # a signal came while it started
        os.kill(proc.pid, passed[0])
    fd = proc.stderr.fileno()
    ended_at = None
    all_closed = False
    while True:
        if ended_at is None and proc.poll() is not None:
            ended_at = time.monotonic()
            os.set_blocking(fd, False)  # from now on: what is in the pipe, not what may still come
        try:
            ready = select.select([fd], [], [], 0.2)[0]
        except InterruptedError:
            continue
        if ready:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                data = None
            if data == b"":
                all_closed = True
                break  # every writer closed the pipe
            if data:
                filt.feed(data)
                if ended_at is None or time.monotonic() - ended_at < DRAIN_S:
                    continue
        if ended_at is not None:
            break
    filt.close()
    proc.wait()
    code = proc.returncode
    code = 128 - code if code < 0 else code
    if passed:
        filt.interrupted = False
        filt.write(_signal_line(name, passed[0], code, all_closed).encode())
        return code if code == 0 else 128 + passed[0]
    if proc.returncode < 0:  # killed by a signal this filter did not pass on (kill -KILL of torchrun)
        filt.write(f"{name} was killed by {signal.Signals(-proc.returncode).name} (not through this runner): exit "
                   f"{code}\n".encode())
    return code


def main() -> None:
    if len(sys.argv) < 2:
        sys.stderr.write(f"usage: python {os.path.basename(__file__)} COMMAND [ARGS...]\n")
        sys.exit(2)
    try:
        code = run(sys.argv[1:])
    except KeyboardInterrupt:  # before the handler was in place
        code = 130
    os._exit(code)  # nothing left to flush into a closed pipe at interpreter exit


if __name__ == "__main__":
    main()
