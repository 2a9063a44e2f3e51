"""stderr filter for launch/run_main.sh: passes every line through until the job's own run-time error
(``dmuon-train: error: ...``, printed once by rank 0 as every rank stops), then drops what follows:
torchrun's report of the children that exited non-zero, which repeats the failure as a traceback.
A crash without the job's error line (a segfault, an unexpected exception) keeps torchrun's report."""
import sys

seen = False
for line in sys.stdin:
    if not seen:
        sys.stderr.write(line)
        sys.stderr.flush()
        seen = line.startswith("dmuon-train: error:")
