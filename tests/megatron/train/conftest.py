"""Runs of the main job that tests in several files read (one run, many assertions)."""
import pytest

from tests.megatron.train.main_job import job


@pytest.fixture(scope="session")
def dmuon_run(tmp_path_factory):
    """DMuon with the main job's defaults (--dmuon-balance cost) at DP 2 for 8 iterations, saving at 4 and 8:
    (its --save root, the finished process). Tests read it and copy it (main_job.stop_at), never write it."""
    root = tmp_path_factory.mktemp("dmuon_run") / "save"
    return root, job("--train-iters", 8, "--save", root, "--save-interval", 4)
