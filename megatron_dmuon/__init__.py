"""megatron_dmuon: owner-centric distributed Muon for Megatron-core."""

__version__ = "0.1.0"
