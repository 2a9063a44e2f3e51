"""The test suite; its folders mirror the package (tests/<layer>/test_<module>.py).

Every folder is a package, so two test files may share a name in different folders (pytest's default
import mode names them tests.megatron.train.test_job and tests.megatron.checkpoint.test_job) and a test
may import another's helpers by that name. ROOT (the checkout) and DATA (tests/data) are defined here once.
Modules that worker processes import by file name (run_distributed's sys_path) compute their paths
themselves: a worker has no `tests` package on its path."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
