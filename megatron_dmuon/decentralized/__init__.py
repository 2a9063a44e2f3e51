"""DeMuon family: decentralized Muon over communication graphs (DeMuon, DeMuon-A, DSGD baselines).

Each agent keeps its own parameters and mixes them with its graph neighbours (gossip) instead of
all-reducing gradients, so this is a different method from the owner-centric DMuon path and
shares nothing with it but the Newton–Schulz math it imports from ``algorithms``.

* ``topology``      – communication graphs, mixing matrices, mixing rate.
* ``extrapolation`` – DeMuon-A's extrapolation offsets and weights.
* ``demuon``        – the five methods on flat agent stacks ``[A, P]`` (pure tensor math).
* ``simulator``     – all agents in one process, a gossip round is one matmul.
* ``agents``        – one agent per rank over torch.distributed, optimizer wrapper.

The DMuon path (``algorithms`` → ``kernels`` → ``planning`` → ``runtime`` → ``megatron``) never
imports this package (tests/test_layers.py checks it).
"""
