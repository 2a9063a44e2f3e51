"""megatron_dmuon: owner-centric distributed Muon for Megatron-core."""

__version__ = "0.1.0"


def _backport_typing_override() -> None:
    """Python 3.11: give ``typing`` the ``override`` decorator of 3.12 (typing_extensions' own,
    a no-op marker), which emerging_optimizers (Megatron's Muon, ``--dmuon-mode
    megatron_layerwise``) imports. megatron-core decides whether it has that package when
    ``megatron.core.optimizer`` is first imported, so this runs with our package's import."""
    import sys

    if sys.version_info >= (3, 12):
        return
    import typing

    if not hasattr(typing, "override"):
        try:
            from typing_extensions import override
        except ImportError:  # megatron-core needs typing_extensions; without it nothing to do
            return
        typing.override = override


_backport_typing_override()
