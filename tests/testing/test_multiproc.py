"""The CPU harness runs real megatron-core DDP + DistributedOptimizer on gloo."""
import os

import torch

from megatron_dmuon.testing.multiproc import run_distributed

HERE = os.path.dirname(__file__)


def test_megatron_distributed_adam_dp2_trains_and_stays_in_sync():
    results = run_distributed("megatron_dmuon.testing.workers:megatron_adam_dp", 2)
    r0, r1 = results
    # the same fixed batch every step: the loss must drop clearly
    assert r0["losses"][-1] < r0["losses"][0] - 0.05, r0["losses"]
    assert r0["losses"] == r1["losses"]
    assert r0["params"].keys() == r1["params"].keys()
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
