"""What each ``--dmuon-mode`` needs and runs, as one table (``MODE_TRAITS``).

``dmuon`` is the product; the other two are baselines that train the same rule for side-by-side
measurements (megatron/baselines.py). The flags' checks, the DDP choice, the trainer, the
Megatron-LM hook and the byte counts read a mode's traits here instead of comparing its name; only
the optimizer's builders (optimizer.py ``OPTIMIZER_BUILDERS``) are keyed by the name itself.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class ModeTraits:
    name: str
    help: str  # --dmuon-mode's help for this mode
    # --use-distributed-optimizer: True needs it, False refuses it (grads are all-reduced), None takes either
    distributed_optimizer: Optional[bool]
    # the DDP that wraps the model: 'owners' (DMuonDDP's owner-aligned buffers), 'layerwise' (Megatron's
    # DDP with its LayerWise optimizer's layout), 'megatron' (Megatron's own DDP, untouched)
    ddp: str
    # DMuon's owner step runs with its options: FP8 publish, --dmuon-overlap-step, one optimizer instance
    owner_step: bool
    # tensor and expert parallelism (TP / EP sizes > 1)
    model_parallel: bool
    # the trainer's --save / --load
    checkpoints: bool
    # the --dmuon-update rules it trains (None: every rule DMuon has)
    updates: Optional[Tuple[str, ...]]
    # Megatron's own Muon runs the matrices: it reads its --muon-* flags itself (its blockwise TP mode,
    # flags newer than DMuon's table)
    megatron_muon: bool
    # available through the Megatron-LM hook (megatron_lm.py); else the trainer and the Python API only
    megatron_lm_hook: bool
    # the --dmuon-* flags it reads, by argparse dest (None: every one). Any other, set to other than its
    # default, is refused by name at parse time (flags.refuse_flags_the_mode_does_not_read): it would
    # run something other than what was asked ([bad-input-5]: --dmuon-ns-method gram ran Megatron's NS)
    dmuon_flags: Optional[Tuple[str, ...]] = None
    # (dest, value) of flags it does not read whose value names what it runs anyway: accepted, so that
    # side-by-side runs can pass every mode one set of flags (Megatron's Muon runs the standard NS)
    runs_as: Tuple[Tuple[str, object], ...] = ()

    @property
    def all_reduces(self) -> bool:
        """Grads are all-reduced on every rank (Megatron's plain DDP), not reduce-scattered."""
        return self.distributed_optimizer is False


MODE_TRAITS = {t.name: t for t in (
    ModeTraits("dmuon", "owners (needs --use-distributed-optimizer)",
               distributed_optimizer=True, ddp="owners", owner_step=True, model_parallel=True, checkpoints=True,
               updates=None, megatron_muon=False, megatron_lm_hook=True),
    # every rank steps every matrix with DMuon's Muon step after Megatron's all-reduce: the step's
    # settings, no owner plan (balance, budget, two-level groups, megabatch, TP method: DP only)
    ModeTraits("gather_then_compute", "the all-reduce baseline",
               distributed_optimizer=False, ddp="megatron", owner_step=False, model_parallel=False,
               checkpoints=False, updates=None, megatron_muon=False, megatron_lm_hook=True,
               dmuon_flags=("dmuon_mode", "dmuon_ns_method", "dmuon_coefficients", "dmuon_ns_launch", "dmuon_update",
                            "dmuon_fraction", "dmuon_fraction_lr", "dmuon_normuon_beta2", "dmuon_split_heads",
                            "dmuon_split_glu", "dmuon_autotune_cache", "dmuon_momentum_dtype",
                            "dmuon_ns_check_interval", "dmuon_ns_check_bound", "dmuon_no_skip_nonfinite")),
    # Megatron's own optimizer: the Muon rule as its --muon-* fields (megatron_lm_flags.megatron_muon_fields)
    ModeTraits("megatron_layerwise", "Megatron's own LayerWise Muon",
               distributed_optimizer=None, ddp="layerwise", owner_step=False, model_parallel=True,
               checkpoints=False, updates=("muon",), megatron_muon=True, megatron_lm_hook=False,
               dmuon_flags=("dmuon_mode", "dmuon_coefficients"), runs_as=(("dmuon_ns_method", "standard"),)),
)}
MODES = tuple(MODE_TRAITS)
# megatron-core 0.19's LayerWise distributed Muon takes bf16 params only (checked at parse time, flags.py)
LAYERWISE_NEEDS_BF16 = (
    "--dmuon-mode megatron_layerwise runs Megatron's LayerWise distributed Muon, which megatron-core 0.19 builds for "
    "bf16 params only (its fp32 chain fails Megatron's own config check, as --optimizer muon "
    "--use-distributed-optimizer does in Megatron-LM): add --bf16")


def mode_traits(mode: str) -> ModeTraits:
    """The traits of ``mode``; an unknown one raises a ValueError naming the flag and the choices."""
    try:
        return MODE_TRAITS[mode]
    except (KeyError, TypeError):
        raise ValueError(f"--dmuon-mode {mode!r} unknown; valid: {', '.join(MODES)}") from None


def modes_training(update: str) -> Tuple[str, ...]:
    """The modes that train ``--dmuon-update update``."""
    return tuple(m.name for m in MODE_TRAITS.values() if m.updates is None or update in m.updates)
