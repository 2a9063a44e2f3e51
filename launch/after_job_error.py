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

Ctrl-C reaches torchrun (the terminal signals the whole foreground process group), which stops the
ranks; the filter keeps reading until torchrun ends, drops what follows the interrupt (every rank's
KeyboardInterrupt traceback, then torchrun's own), says in one line that the job was interrupted, and
exits with torchrun's status; no traceback of its own. SIGTERM is passed on to torchrun. A closed stderr (``run_main.sh 2>&1 | head``) is not an
error: the rest is read and dropped, the status is the job's.
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
        self.interrupted = False  # Ctrl-C: drop the rest
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


def run(cmd) -> int:
    filt = Filter(sys.stderr.fileno())

    def interrupt(*_):  # torchrun has it too (the terminal's process group): it stops the job
        filt.interrupted = True

    signal.signal(signal.SIGINT, interrupt)
    try:
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    except OSError as e:
        filt.write(f"{os.path.basename(__file__)}: cannot run {cmd[0]}: {e.strerror}\n".encode())
        return 127
    signal.signal(signal.SIGTERM, lambda *_: proc.poll() is None and proc.send_signal(signal.SIGTERM))
    fd = proc.stderr.fileno()
    ended_at = None
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
    if filt.interrupted:
        filt.write(f"interrupted (Ctrl-C): torchrun stopped the ranks and exited with {code}\n".encode())
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
