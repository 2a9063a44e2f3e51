"""Pretrain a megatron-core GPT with DMuon (or Megatron's AdamW): the project's main job.

    ./launch/run_main.sh --optimizer dmuon                                          # picks the entry below
    torchrun --nproc-per-node 8 -m megatron_dmuon.megatron.train --bf16             # GPUs (NCCL); or dmuon-train
    torchrun --nproc-per-node 2 -m megatron_dmuon.testing.cpu_train                 # 2 CPU ranks (gloo)

Data: byte-level tokens of the Python standard library's source (on every machine), or a Megatron
indexed dataset with --data-path PREFIX (the .bin/.idx pair); the last 5% held out (--split) for the
validation loss. Prints Megatron-style progress lines. Every flag, the data, the paths and a memory
bound are checked before anything is built (megatron_dmuon/megatron/train/checks.py; --parse-only
stops there).

Checkpoints as Megatron-LM's: --save DIR --save-interval N writes DIR/iter_NNNNNNN (torch_dist:
model, DMuon's per-parameter optimizer state, scheduler) and DIR/latest_checkpointed_iteration.txt;
--load DIR resumes from the latest one (and starts fresh if DIR holds none, so one command line
serves a first run and its restarts under `torchrun --max-restarts`). One run writes a --save
directory at a time (a lock file in it).
"""
from __future__ import annotations

import argparse

from ..modes import mode_traits
from .checks import JobArgumentParser, validate_args

# The main job's Muon settings (what the launch recipes use): momentum 0.95 with Nesterov, and
# Megatron's 'spectral' scale sqrt(max(rows, cols)) times 0.2, which gives a Muon update the RMS of
# an AdamW one (Moonlight), so one --lr serves the Muon matrices and the AdamW params alike.
# bench/quality.py measured them (docs/quality.md). The library's DMuonConfig() and the
# Megatron-LM hook keep Megatron's own defaults (0.9, no Nesterov, extra scale 1).
# --lr when none is given: each optimizer at its best lr of bench/quality.py's sweeps on the GPU
# models (6 x 512 at 800 iterations and 12 x 768: DMuon 3e-3 on both; AdamW 1e-3 and 3e-4;
# docs/quality.md). This job's tiny default model would take more (1.2e-2), larger models less.
DEFAULT_LR = {"dmuon": 3e-3, "adam": 1e-3}
MAIN_JOB_MUON_DEFAULTS = dict(muon_momentum=0.95, muon_nesterov=True, muon_scale_mode="spectral",
                              muon_extra_scale_factor=0.2)


def parse_args(argv=None):
    """The job's flags, checked (usage errors exit 2 naming the flag)."""
    from megatron_dmuon.megatron.flags import add_dmuon_args
    from megatron_dmuon.megatron.gpt import FP8_FORMATS, FP8_RECIPES, TRANSFORMER_IMPLS

    p = JobArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--optimizer", default="dmuon", choices=["dmuon", "adam"])
    add_dmuon_args(p, validate=False)  # Megatron's --muon-* flags and DMuon's --dmuon-* flags (checked below)
    p.set_defaults(**MAIN_JOB_MUON_DEFAULTS)
    a("--muon-no-nesterov", dest="muon_nesterov", action="store_false",
      help="plain momentum (Megatron's default; this job's default is Nesterov)")
    a("--num-layers", type=int, default=2)
    a("--hidden-size", type=int, default=128)
    a("--ffn-hidden-size", type=int, default=None,
      help="MLP width (default: 352 for the default --hidden-size 128; for another --hidden-size Megatron-LM's "
           "rule for a SwiGLU MLP, int(4 x hidden x 2/3 / 64) x 64)")
    a("--num-attention-heads", type=int, default=4)
    a("--num-query-groups", type=int, default=2)
    a("--seq-length", type=int, default=128)
    a("--vocab-size", type=int, default=256, help="256 for the byte-level default data")
    a("--micro-batch-size", type=int, default=4)
    a("--global-batch-size", type=int, default=16)
    a("--train-iters", type=int, default=60)
    a("--lr", type=float, default=None,
      help=f"peak lr (default: each optimizer's best of bench/quality.py's sweeps: {DEFAULT_LR})")
    a("--min-lr", type=float, default=None, help="final lr of the cosine decay (default: --lr / 10)")
    a("--lr-warmup-iters", type=int, default=5)
    a("--decoupled-lr", type=float, default=None,
      help="peak lr of the input embedding and output layer (Megatron-LM's flag; default: --lr)")
    a("--decoupled-min-lr", type=float, default=None, help="their final lr (Megatron-LM's flag)")
    a("--weight-decay", type=float, default=0.1)
    a("--clip-grad", type=float, default=1.0)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.95)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--num-distributed-optimizer-instances", type=int, default=1,
      help="Megatron-LM's partial distributed optimizer: the optimizer is sharded inside each of N instances of "
           "DP / N ranks and the gradients all-reduced across them (docs/dmuon_dp.md)")
    a("--bf16", action="store_true")
    a("--transformer-impl", choices=TRANSFORMER_IMPLS, default=None,
      help="the layers: Transformer Engine's (Megatron-LM's default; the default here where transformer_engine "
           "imports on a GPU) or megatron-core's local ones (the default elsewhere)")
    a("--fp8-format", choices=FP8_FORMATS, default=None,
      help="FP8 GEMMs through Transformer Engine (needs --bf16 and TE layers), as Megatron-LM's flag")
    a("--fp8-recipe", choices=FP8_RECIPES, default="delayed",
      help="FP8 scaling: delayed (amax history) or tensorwise (current scaling)")
    a("--fp8-param-gather", action="store_true",
      help="keep TE's params in FP8: owners re-quantize them from their fp32 masters and the param all-gather "
           "moves FP8 bytes (needs --fp8-format)")
    a("--gradient-accumulation-fusion", action="store_true",
      help="TE layers accumulate wgrad straight into the owner-aligned grad buffers (Megatron-LM's default with TE); "
           "the output layer then needs Apex's fused_weight_gradient_mlp_cuda (launch/build_apex_wgrad.sh)")
    a("--overlap-grad-reduce", action="store_true")
    a("--overlap-param-gather", action="store_true")
    a("--data-path", default=None, help="Megatron indexed dataset prefix (.bin/.idx)")
    a("--split", default="95,5", help="train,valid[,test] weights as Megatron-LM's, in that order over the data (the "
      "stdlib files in name order, or the dataset's documents): 95,5 validates on the last 5%%; a test share, the "
      "last, is never read")
    a("--tensorboard-dir", default=None,
      help="write DMuon's metrics (docs/metrics.md) and the lm loss there at every --log-interval, as Megatron-LM does")
    a("--wandb-project", default=None, help="also log them to this W&B project (offline unless WANDB_API_KEY is set)")
    a("--wandb-exp-name", default=None, help="the W&B run's name")
    a("--wandb-save-dir", default=None, help="where W&B keeps its run files (default: --tensorboard-dir, else ./wandb)")
    a("--eval-interval", type=int, default=None,
      help="validation loss every N iterations (and after the last); default: after the last only")
    a("--eval-iters", type=int, default=4, help="validation batches (each --global-batch-size windows) per evaluation; 0: none")
    a("--seed", type=int, default=1234)
    a("--log-interval", type=int, default=10)
    a("--timing-json", default=None, help="write per-iteration timings here (rank 0)")
    a("--profile-optimizer-at", type=int, default=None, metavar="ITER",
      help="profile the optimizer step of this iteration (torch.profiler, rank 0): a kernel table on stdout, "
           "and a Chrome trace at --profile-out")
    a("--profile-out", default=None, help="Chrome trace file for --profile-optimizer-at")
    a("--profile-iterations", type=int, default=0, metavar="N",
      help="with --profile-optimizer-at ITER: profile N whole iterations from ITER (forward, backward and step, "
           "so --dmuon-overlap-step on's Newton-Schulz shows beside the next forward) instead of the step alone")
    a("--exit-after-skipped-iterations", type=int, default=10, metavar="K",
      help="stop with an error after K consecutive iterations whose update was skipped (non-finite gradients) "
           "or whose loss was not finite; 0: never")
    a("--parse-only", action="store_true", help="check the arguments (and the data, paths, memory bound) and exit")
    _add_checkpoint_args(p)
    args = p.parse_args(argv)
    validate_args(p, args, DEFAULT_LR, p.given(argv))  # (given: a flag the run would ignore is refused by name)
    # what Megatron-LM reads from --use-distributed-optimizer: DMuon's owners need it, the
    # all-reduce baseline must not have it
    args.use_distributed_optimizer = not (args.optimizer == "dmuon" and mode_traits(args.dmuon_mode).all_reduces)
    return args


def _add_checkpoint_args(p):
    a = p.add_argument
    a("--save", default=None, help="checkpoint directory (Megatron-LM torch_dist layout)")
    a("--save-interval", type=int, default=None, help="save every N iterations (and after the last one)")
    a("--load", default=None, help="resume from the latest checkpoint in this directory (none there: start fresh)")
    a("--no-load-optim", action="store_true",
      help="--load the model only (Megatron-LM's flag): optimizer state and lr schedule start fresh; the iteration "
           "and the consumed samples continue")
    a("--override-opt_param-scheduler", dest="override_opt_param_scheduler", action="store_true",
      help="resume under this run's lr/wd schedule flags when the checkpoint's differ (Megatron-LM's flag)")
    a("--use-checkpoint-opt_param-scheduler", dest="use_checkpoint_opt_param_scheduler", action="store_true",
      help="resume under the checkpoint's lr/wd schedule whatever this run's flags say (Megatron-LM's flag)")
    a("--fail-at-iteration", type=int, default=None,
      help="fault injection: SIGKILL --fail-rank at the start of this iteration, on the first torchrun attempt only")
    a("--fail-rank", type=int, default=-1, help="global rank --fail-at-iteration kills (-1: the last)")
