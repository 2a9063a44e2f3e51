"""Megatron-Bridge users' door to DMuon: ``from megatron_dmuon.bridge import use_dmuon`` and
``torchrun ... -m megatron_dmuon.bridge [--dmuon-* flags] SCRIPT.py ...``. Everything Bridge lives in
megatron_dmuon/megatron/bridge/ (how to use it: its __init__.py; docs/bridge.md)."""
from __future__ import annotations

from .megatron.bridge import __getattr__, bridge_names  # noqa: F401 (the adapter's names load on first use)

if __name__ == "__main__":
    from .megatron.bridge.__main__ import main

    main()
