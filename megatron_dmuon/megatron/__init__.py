"""DMuon on megatron-core: owner-aligned DDP layout, the DMuon optimizer, and the Megatron-LM hook.

    import megatron_dmuon.megatron
    megatron_dmuon.megatron.install()   # in a Megatron-LM entry script: adds --optimizer dmuon
"""


def install() -> None:
    """Add `--optimizer dmuon` to Megatron-LM's `pretrain_gpt.py` (see megatron_lm.install)."""
    from .megatron_lm import install as _install

    _install()
