"""The main job's checks: every flag, the data, the file system and a memory bound before anything
is built (the ones that stop a run while it runs: run_errors.py).

Start-up errors go through ``JobArgumentParser.error``: argparse's usage line and message, printed by
rank 0 only (the other ranks exit silently), exit code 2. ``launch/run_main.sh`` runs these checks once
in a single process before torchrun starts (``--parse-only``), so a usage error prints one block.
Run-time errors go through ``run_errors.job_error`` (rank 0 prints, every rank exits).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

from ..modes import LAYERWISE_NEEDS_BF16, mode_traits
from .data import check_indexed_dataset, parse_split, token_source, train_split_problem
from .output_paths import check_outputs_against_inputs, dir_problem, file_problem

PROG = "dmuon-train"  # the trainer's name in its messages, whichever entry started it


def _prints_errors() -> bool:
    """Whether this process prints the start-up errors every rank meets: rank 0 (or no RANK: one
    process); also a process whose RANK is no rank of WORLD_SIZE (then no rank 0 may exist to say why)."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    except ValueError:
        return True
    return rank == 0 or (world is not None and not 0 <= rank < world)


class JobArgumentParser(argparse.ArgumentParser):
    """argparse, with its error printed by one rank (``RANK`` 0 or unset) only."""

    def __init__(self, **kwargs):
        super().__init__(prog=PROG, **kwargs)

    def error(self, message):
        if _prints_errors():
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
            sys.stderr.flush()
        raise SystemExit(2)

    def given(self, argv=None) -> dict:
        """The flags given on the command line (abbreviated, ``--flag=value`` or not): ``{dest: the
        option string typed}``. argparse fills in a default only where the namespace lacks the dest,
        so a second parse into a namespace pre-filled with a marker leaves the marker on every flag
        that was not given."""
        argv = sys.argv[1:] if argv is None else list(argv)
        unset = object()
        dests = {a.dest for a in self._actions if a.dest is not argparse.SUPPRESS}
        namespace = argparse.Namespace(**{dest: unset for dest in dests})
        self.parse_known_args(argv, namespace)
        given = {}
        for dest in sorted(d for d in dests if getattr(namespace, d) is not unset):
            options = [o for a in self._actions if a.dest == dest for o in a.option_strings]
            typed = [a.split("=", 1)[0] for a in map(str, argv) if a.startswith("--")]
            # the option string the user typed (an abbreviation names the option it stands for)
            hit = next((o for t in typed for o in options if o == t), None) or \
                next((o for t in typed for o in options if o.startswith(t)), options[0] if options else dest)
            given[dest] = hit
        return given


def validate_args(p, args, default_lr: dict, given: dict = None) -> None:
    """Every argument checked before anything is built; errors name the flag (argparse exit 2).
    ``given``: the flags on the command line (``JobArgumentParser.given``; None: none assumed given)."""
    from megatron_dmuon.megatron.flags import check_training_numbers

    typed, given = given, given or {}
    _check_environment(p)
    _check_path_flags_name_something(p, args)
    _refuse_unused_flags(p, args, given)
    check_outputs_against_inputs(p, args)  # (before any other check could read or write a file)
    ffn_derived = args.ffn_hidden_size is None
    if ffn_derived:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size)
    if args.lr is None:
        args.lr = default_lr[args.optimizer]
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    positive = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "seq_length", "vocab_size", "micro_batch_size", "global_batch_size", "train_iters", "log_interval",
                "tensor_model_parallel_size", "pipeline_model_parallel_size")
    for name in positive:
        if getattr(args, name) < 1 and not (ffn_derived and name == "ffn_hidden_size"):  # (derived: below)
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    for name in ("lr_warmup_iters", "eval_iters", "exit_after_skipped_iterations"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(args, name)})")
    if not 0 <= args.seed < 2**32:  # numpy's and Megatron's per-rank seeds derive from it
        p.error(f"--seed must be in [0, 2^32) (got {args.seed})")
    if args.optimizer != "dmuon":  # (for dmuon, validate_dmuon_args below checks them with the rest)
        try:
            check_training_numbers(args)  # lr, min-lr, weight decay, clipping, Adam betas: finite, in range
        except ValueError as e:
            p.error(str(e))
    if args.lr_warmup_iters >= args.train_iters:
        p.error(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than --train-iters ({args.train_iters})")
    _check_layout(p, args)
    if args.ffn_hidden_size < 1:  # (derived from a small --hidden-size)
        p.error(f"--hidden-size {args.hidden_size} gives Megatron-LM's default --ffn-hidden-size int(4 x "
                f"{args.hidden_size} x 2/3 / 64) x 64 = {args.ffn_hidden_size} (SwiGLU): give --ffn-hidden-size")
    if args.ffn_hidden_size % args.tensor_model_parallel_size:  # (a derived one; _check_layout named a given one)
        p.error(f"--ffn-hidden-size {args.ffn_hidden_size} (Megatron-LM's default for --hidden-size "
                f"{args.hidden_size}) must be divisible by --tensor-model-parallel-size {args.tensor_model_parallel_size}: "
                "give --ffn-hidden-size")
    _check_transformer_engine(p, args)
    if args.optimizer == "dmuon":  # every --muon-*/--dmuon-* flag and DMuon's combination checks
        from megatron_dmuon.megatron.flags import validate_dmuon_args

        try:
            validate_dmuon_args(args, typed)  # (None: the config counts a flag off its default as given)
        except ValueError as e:
            p.error(str(e))
        if mode_traits(args.dmuon_mode).ddp == "layerwise" and not args.bf16:  # (the job runs it distributed)
            p.error(LAYERWISE_NEEDS_BF16)
    _check_run_flags(p, args, given)
    for flag, path in (("--timing-json", args.timing_json), ("--profile-out", args.profile_out)):
        problem = file_problem(path)
        if problem:
            p.error(f"{flag} {path}: {problem}")
    _check_checkpointing(p, args)
    _check_data(p, args)
    _check_memory(p, args)


# the default model's FFN width (2.75 x its --hidden-size 128); other hidden sizes get Megatron-LM's rule
DEFAULT_HIDDEN_SIZE, DEFAULT_FFN_HIDDEN_SIZE = 128, 352


def default_ffn_hidden_size(hidden_size: int) -> int:
    """--ffn-hidden-size when none is given: the default model's 352 at its --hidden-size 128, else
    Megatron-LM's rule for this job's SwiGLU MLP (arguments.py: int(4 x hidden x 2/3 / 64) x 64, which
    keeps the parameters of a 4 x hidden GELU MLP, in multiples of 64)."""
    if hidden_size == DEFAULT_HIDDEN_SIZE:
        return DEFAULT_FFN_HIDDEN_SIZE
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def _env_int(p, name: str, low: int, high=None, default=None):
    """An integer environment variable the job reads, in [low, high) (None: unset), else a usage error."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        p.error(f"the environment variable {name}={text!r} must be an integer {bound} (torchrun sets it; unset it "
                "to run one process)")
    return value


def _check_environment(p) -> None:
    """What the job reads from the environment (torchrun's variables): integers in range."""
    world = _env_int(p, "WORLD_SIZE", 1)  # (None: unset, one process)
    _env_int(p, "RANK", 0, world)
    local_world = _env_int(p, "LOCAL_WORLD_SIZE", 1, world + 1 if world else None)
    _env_int(p, "LOCAL_RANK", 0, local_world or world)
    _env_int(p, "TORCHELASTIC_RESTART_COUNT", 0)
    if os.environ.get("MASTER_ADDR") is not None:
        _env_int(p, "MASTER_PORT", 1, 65536)
        if not os.environ["MASTER_ADDR"].strip():
            p.error("the environment variable MASTER_ADDR is empty: set it to the address of rank 0, or unset it")


# the main job's path flags (an empty value would silently mean "none": the default data, no save)
PATH_FLAGS = ("data_path", "save", "load", "timing_json", "profile_out", "dmuon_autotune_cache")


def _check_path_flags_name_something(p, args) -> None:
    for name in PATH_FLAGS:
        value = getattr(args, name, None)
        if value is not None and not value.strip():
            flag = f"--{name.replace('_', '-')}"
            p.error(f"{flag} {value!r} names no path: " + (
                "give the prefix of a Megatron indexed dataset (PREFIX.bin and PREFIX.idx), or leave --data-path out "
                "for the default data" if name == "data_path" else f"give a path, or leave {flag} out"))


def _refuse_unused_flags(p, args, given: dict) -> None:
    """A flag the run would ignore is refused by name (a value given and never read is a mistake the
    user should hear of): every --muon-*/--dmuon-* flag under --optimizer adam (under --optimizer dmuon,
    the config refuses those it does not read: ``validate_dmuon_args(args, given)``)."""
    if args.optimizer == "adam":
        for dest, typed in given.items():
            if typed.startswith(("--muon-", "--dmuon-")):
                p.error(f"{typed} has no effect under --optimizer adam; drop it or use --optimizer dmuon")


LOAD_FLAGS = {"no_load_optim": "--no-load-optim", "use_checkpoint_opt_param_scheduler": "--use-checkpoint-opt_param-scheduler",
              "override_opt_param_scheduler": "--override-opt_param-scheduler"}


def _check_run_flags(p, args, given: dict) -> None:
    """The profiling, fault-injection, validation and checkpoint flags: in range, and refused where
    they would have no effect."""
    if args.profile_optimizer_at is not None and not 1 <= args.profile_optimizer_at <= args.train_iters:
        p.error(f"--profile-optimizer-at must be in [1, --train-iters] (got {args.profile_optimizer_at})")
    if args.profile_out and args.profile_optimizer_at is None:
        p.error("--profile-out needs --profile-optimizer-at ITER (the iteration whose optimizer step to profile)")
    if args.profile_iterations and (args.profile_iterations < 0 or args.profile_optimizer_at is None
                                    or args.profile_optimizer_at + args.profile_iterations - 1 > args.train_iters):
        p.error(f"--profile-iterations {args.profile_iterations} needs --profile-optimizer-at ITER with "
                "ITER + N - 1 <= --train-iters (the whole iterations to profile)")
    if args.fail_at_iteration is not None and not 1 <= args.fail_at_iteration <= args.train_iters:
        p.error(f"--fail-at-iteration must be in [1, --train-iters] (got {args.fail_at_iteration})")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if "fail_rank" in given and args.fail_at_iteration is None:
        p.error("--fail-rank has no effect without --fail-at-iteration ITER (the iteration at which to kill it)")
    if not -1 <= args.fail_rank < world:
        p.error(f"--fail-rank must be a global rank in [0, {world}) or -1 for the last (got {args.fail_rank})")
    if args.eval_interval is not None and args.eval_interval < 1:
        p.error(f"--eval-interval must be >= 1 (got {args.eval_interval}); --eval-iters 0 turns validation off")
    if args.eval_interval is not None and args.eval_iters == 0:
        p.error("--eval-interval has no effect with --eval-iters 0 (no validation): drop one of the two")
    if "fp8_recipe" in given and not args.fp8_format:
        p.error(f"--fp8-recipe {args.fp8_recipe} has no effect without --fp8-format: add --fp8-format hybrid|e4m3, "
                "or drop it")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        p.error("--decoupled-min-lr has no effect without --decoupled-lr (Megatron reads it only as the decoupled "
                "lr's minimum): add --decoupled-lr, or drop it")
    if args.overlap_param_gather and args.optimizer == "dmuon" and mode_traits(args.dmuon_mode).all_reduces:
        p.error(f"--overlap-param-gather has no effect under --dmuon-mode {args.dmuon_mode} (an all-reduce "
                "baseline without the distributed optimizer's param all-gather): drop it")
    if not args.load:
        for dest, flag in LOAD_FLAGS.items():
            if getattr(args, dest):
                p.error(f"{flag} has no effect without --load DIR")
    if args.no_load_optim:
        for dest, flag in list(LOAD_FLAGS.items())[1:]:
            if getattr(args, dest):
                p.error(f"{flag} has no effect with --no-load-optim: as in "
                        "Megatron-LM, the lr schedule is loaded with the optimizer state, so --no-load-optim starts it "
                        "fresh (the iteration and consumed samples continue); drop one of the two")


def _check_layout(p, args) -> None:
    """Parallel sizes first (their errors explain the rest), then what they must divide."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % (tp * pp):
        p.error(f"the world size {world} must be a multiple of --tensor-model-parallel-size x "
                f"--pipeline-model-parallel-size = {tp * pp} (start as many ranks, or lower the parallel sizes)")
    for name in ("num_query_groups", "num_attention_heads", "ffn_hidden_size"):
        if getattr(args, name) % tp:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be divisible by --tensor-model-parallel-size {tp}")
    if args.num_layers % pp:
        p.error(f"--num-layers {args.num_layers} must be divisible by --pipeline-model-parallel-size {pp}")
    if args.hidden_size % args.num_attention_heads:
        p.error(f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads {args.num_attention_heads}")
    if args.num_attention_heads % args.num_query_groups:
        p.error(f"--num-attention-heads {args.num_attention_heads} must be divisible by --num-query-groups "
                f"{args.num_query_groups}")
    if args.vocab_size % tp:
        p.error(f"--vocab-size {args.vocab_size} must be divisible by --tensor-model-parallel-size {tp} (each TP rank "
                "holds an equal slice of the embedding and output layer): pad the vocabulary to a multiple of it")
    head_dim = args.hidden_size // args.num_attention_heads
    if head_dim % 2:
        p.error(f"--hidden-size / --num-attention-heads = {head_dim}, the head dimension, must be even: rotary "
                "position embeddings rotate pairs of channels")
    dp = world // (tp * pp)
    instances = args.num_distributed_optimizer_instances
    if instances < 1 or dp % instances:
        p.error(f"--num-distributed-optimizer-instances {instances} must be >= 1 and divide DP = {dp} (each instance "
                "shards the optimizer over DP / instances ranks)")
    if instances > 1 and args.optimizer == "dmuon" and mode_traits(args.dmuon_mode).all_reduces:
        p.error(f"--num-distributed-optimizer-instances {instances} shards the distributed optimizer; "
                f"--dmuon-mode {args.dmuon_mode} has none: drop the flag, or pass --dmuon-mode dmuon")
    if args.global_batch_size % (args.micro_batch_size * dp):
        p.error(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size x DP = "
                f"{args.micro_batch_size} x {dp}")


def transformer_engine_importable() -> bool:
    """Whether Transformer Engine's PyTorch layers import on a CUDA machine."""
    try:
        if not torch.cuda.is_available():
            return False
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a TE build that does not load here
        return False
    return True


def _check_transformer_engine(p, args) -> None:
    """--transformer-impl (default: TE where it imports on a GPU, as Megatron-LM's runs use it) and the
    FP8 / fused-wgrad flags that need it."""
    te = transformer_engine_importable()
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if te else "local"
    if args.transformer_impl == "transformer_engine" and not te:
        p.error("--transformer-impl transformer_engine needs a CUDA GPU and Transformer Engine (transformer_engine "
                "does not import here); use --transformer-impl local")
    need_te = [flag for flag, on in (("--fp8-format", args.fp8_format), ("--gradient-accumulation-fusion",
                                                                        args.gradient_accumulation_fusion)) if on]
    if need_te and args.transformer_impl != "transformer_engine":
        p.error(f"{need_te[0]} needs Transformer Engine's layers (--transformer-impl transformer_engine)")
    if args.fp8_param_gather and not args.fp8_format:
        p.error("--fp8-param-gather keeps FP8 params: it needs --fp8-format hybrid|e4m3")
    if args.fp8_format:
        if not args.bf16:
            p.error("--fp8-format needs --bf16 (FP8 GEMMs on bf16 params and activations, as Megatron-LM runs them)")
        tokens = args.micro_batch_size * args.seq_length
        head_dim = args.hidden_size // args.num_attention_heads
        qkv = (args.num_attention_heads + 2 * args.num_query_groups) * head_dim
        for name, value in (("--hidden-size", args.hidden_size), ("--ffn-hidden-size", args.ffn_hidden_size),
                            ("the QKV width (heads + 2 x query groups) x head dim", qkv),
                            ("--micro-batch-size x --seq-length", tokens)):
            if value % 16:
                p.error(f"--fp8-format: {name} = {value} must be a multiple of 16 (TE's FP8 GEMMs)")
    if args.gradient_accumulation_fusion:
        try:
            import fused_weight_gradient_mlp_cuda  # noqa: F401
        except Exception:  # noqa: BLE001
            p.error("--gradient-accumulation-fusion needs Apex's fused_weight_gradient_mlp_cuda for the (non-TE) "
                    "output layer: build it with launch/build_apex_wgrad.sh, or drop the flag")


# the flags that define this job's model: a checkpoint records them (checkpoints.save) and a --load
# under other values is refused (the same tensor shapes can mean another model: heads vs groups)
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "vocab_size", "transformer_impl")


def model_config_of(args) -> dict:
    return {name: getattr(args, name) for name in MODEL_FLAGS}


def schedule_of(args) -> dict:
    """The lr / weight-decay schedule of Megatron's OptimizerParamScheduler under the flags (Megatron
    counts samples); a resume compares it with the checkpoint's."""
    samples = args.train_iters * args.global_batch_size
    return dict(max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
                lr_decay_steps=samples, lr_decay_style="cosine", start_wd=args.weight_decay,
                end_wd=args.weight_decay, wd_incr_steps=samples, wd_incr_style="constant")


def _check_schedule_matches(p, args, saved) -> None:
    """As Megatron-LM: a resume under other schedule values needs --override-opt_param-scheduler (this
    run's) or --use-checkpoint-opt_param-scheduler (the checkpoint's), else it would silently keep one."""
    if args.no_load_optim or not isinstance(saved, dict) or args.override_opt_param_scheduler \
            or args.use_checkpoint_opt_param_scheduler:
        return
    mine = schedule_of(args)
    differ = [f"{k} {saved[k]} -> {mine[k]}" for k in mine if k in saved and saved[k] != mine[k]]
    if differ:
        p.error(f"--load {args.load}: the checkpoint's lr/wd schedule differs from this run's ({', '.join(differ)}; "
                "e.g. a raised --train-iters or a new --lr): pass --override-opt_param-scheduler to resume under "
                "this run's flags, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def _check_resume(p, args, iteration: int) -> None:
    """The checkpoint --load resumes from, before anything is built: it reads (else it is named as damaged,
    with the last one that does), it holds this run's model and an optimizer state this run can take, and
    its lr schedule is this run's unless Megatron-LM's flag says which wins. Refused by name."""
    from megatron.core import dist_checkpointing

    from megatron_dmuon.megatron.checkpoint.job import TRACKER, checkpoint_dir, checkpoint_problem, complete_iterations
    from megatron_dmuon.megatron.checkpoint.trusted_read import UntrustedCheckpointError

    path = checkpoint_dir(args.load, iteration)
    try:
        problem = checkpoint_problem(path)
        older = [i for i in complete_iterations(args.load) if i < iteration and not checkpoint_problem(
            checkpoint_dir(args.load, i))] if problem else []
    except UntrustedCheckpointError as e:  # named before Megatron's reader would unpickle it
        p.error(f"--load {args.load}: {e}")
    if problem:
        tracker = os.path.join(args.load, TRACKER)
        p.error(f"--load {args.load}: the checkpoint {path} is damaged: {problem}; " + (
            f"the last complete checkpoint that reads is iteration {older[-1]}: write {older[-1]} into {tracker} to "
            "resume from it" if older else f"no earlier checkpoint there reads: remove {tracker} to start fresh"))
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:  # noqa: BLE001 - any reader failure: a damaged checkpoint
        p.error(f"--load {args.load}: {path} is damaged: its common state does not read ({type(e).__name__}: {e})")
    saved = common.get("model_config") if isinstance(common, dict) else None
    mine = model_config_of(args)
    # (a checkpoint saved before checkpoints recorded their model has its shapes checked at load)
    differ = [name for name in MODEL_FLAGS if saved and name in saved and saved[name] != mine[name]]
    if differ:
        flags = lambda cfg: " ".join(f"--{n.replace('_', '-')} {cfg[n]}" for n in differ)  # noqa: E731
        p.error(f"--load {args.load}: {path} was saved by another model ({flags(saved)}; this run: {flags(mine)}); "
                "pass the checkpoint's values, or another --load")
    if args.optimizer == "dmuon" and not args.no_load_optim and isinstance(common, dict):
        from megatron_dmuon.megatron.checkpoint.switch import megatron_source

        source = megatron_source(common.get("optimizer"))
        if source is not None and not source["muon_groups"]:  # (Megatron's Muon: DMuon continues it at load)
            p.error(f"--load {args.load}: {path} was written by --optimizer adam, with no Muon momenta to keep: load "
                    "the model only (--no-load-optim) to start DMuon's state fresh, or train on with --optimizer adam")
    if args.optimizer == "adam" and not args.no_load_optim and isinstance(common, dict):
        saver = muon_saver_of(common.get("optimizer"))
        if saver:  # every matrix steps by AdamW here: its Muon momenta are no AdamW moments
            p.error(f"--load {args.load}: {path} was written by {saver}, whose Muon momenta --optimizer adam cannot "
                    "continue (it has no AdamW moments for those matrices): load the model only (--no-load-optim) to "
                    "start AdamW's state fresh, or train on with --optimizer dmuon")
    _check_schedule_matches(p, args, common.get("opt_param_scheduler") if isinstance(common, dict) else None)


def muon_saver_of(common_optimizer):
    """Which Muon optimizer wrote a checkpoint's common ``optimizer`` record, in the flags' words (None:
    no Muon matrix in it, e.g. Megatron's Adam)."""
    from megatron_dmuon.megatron.checkpoint.switch import dmuon_record_of, megatron_source

    record = dmuon_record_of(common_optimizer)
    if record is not None:
        params = record.get("params")
        kinds = [v[1] for v in params.values() if isinstance(v, (list, tuple)) and len(v) > 1] \
            if isinstance(params, dict) else ["muon"]
        return "--optimizer dmuon" if "muon" in kinds else None
    source = megatron_source(common_optimizer)
    if source is not None and source["muon_groups"]:
        return "Megatron's Muon (--optimizer muon, or --dmuon-mode megatron_layerwise)"
    return None


# what a save writes into --save beside its iter_NNNNNNN directories (checkpoint/job.py, checkpoints.py)
SAVE_DIR_FILES = ("latest_checkpointed_iteration.txt", "latest_checkpointed_iteration.txt.tmp", ".dmuon_save.lock")


def _check_checkpointing(p, args) -> None:
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        p.error("--save-interval needs --save DIR and must be >= 1")
    if args.save:
        problem = dir_problem(args.save)
        if problem:
            p.error(f"--save {args.save}: {problem}")
        if os.path.isdir(os.path.join(args.save, ".dmuon_save.lock")):
            p.error(f"--save {args.save}: its lock file .dmuon_save.lock is a directory: remove it")
        written = sorted(n for n in (os.listdir(args.save) if os.path.isdir(args.save) else ())
                         if re.fullmatch(r"iter_\d{7}", n) or n in SAVE_DIR_FILES)
        linked = [n for n in written if os.path.islink(os.path.join(args.save, n))]
        if linked:  # a save replaces (rmtree) or rewrites it: never through a link into another directory
            target = os.readlink(os.path.join(args.save, linked[0]))
            p.error(f"--save {args.save}: {linked[0]} is a symbolic link (to {target}) where the job writes its own "
                    "file: remove the link, or save elsewhere")
        blocking = [n for n in written if n.startswith("iter_") and not os.path.isdir(os.path.join(args.save, n))]
        if blocking:
            p.error(f"--save {args.save}: {blocking[0]} is a file where a checkpoint directory would be written: "
                    "remove it, or save elsewhere")
    if args.load and os.path.exists(args.load) and not os.path.isdir(args.load):
        p.error(f"--load {args.load} is not a directory")
    if (args.save or args.load) and args.optimizer == "dmuon" and not mode_traits(args.dmuon_mode).checkpoints:
        p.error(f"--save/--load support --dmuon-mode dmuon (and --optimizer adam); --dmuon-mode {args.dmuon_mode} "
                "is a comparison baseline without checkpoints")
    from megatron_dmuon.megatron.checkpoint import CheckpointMismatchError
    from megatron_dmuon.megatron.checkpoint.job import TRACKER, complete_iterations, latest_iteration, resume_iteration

    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        p.error("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler ask for opposite schedules: "
                "pass one")
    if args.load:
        if os.path.isfile(os.path.join(args.load, "metadata.json")) and not os.path.exists(os.path.join(args.load, TRACKER)):
            p.error(f"--load {args.load} is one checkpoint, not the directory that holds them: pass "
                    f"--load {os.path.dirname(os.path.abspath(args.load))} (its {TRACKER} names the iteration to resume)")
        try:
            iteration = resume_iteration(args.load)
        except CheckpointMismatchError as e:
            p.error(f"--load {args.load}: {e}")
        if iteration is not None:
            _check_resume(p, args, iteration)
    if args.save and (not args.load or os.path.abspath(args.load) != os.path.abspath(args.save)):
        try:
            held = latest_iteration(args.save)
        except CheckpointMismatchError as e:
            p.error(f"--save {args.save}: {e}")
        complete = complete_iterations(args.save)
        if held is not None or complete:
            last = held if held is not None else complete[-1]
            p.error(f"--save {args.save} holds the checkpoints of another run (up to iteration {last}); this run "
                    "would write its iterations beside them and move the tracker back: pass --load "
                    f"{args.save} to continue that run, or save into another directory")


def _check_data(p, args) -> None:
    try:
        parse_split(args.split)
    except ValueError as e:
        p.error(str(e))
    if args.data_path is None:
        if args.vocab_size < 256:
            p.error("--vocab-size must be >= 256 for the byte-level default data")
        problem = train_split_problem(args)
        if problem:
            p.error(problem)
        return
    try:
        check_indexed_dataset(args.data_path)
        token_source(args)  # token ids < --vocab-size, the train split longer than one window
    except ValueError as e:
        p.error(str(e))


def model_state_bytes(args) -> int:
    """A lower bound of what this rank holds before any activation: its share of the params (TP x PP
    split them) in the model's dtype plus their fp32 grad buffer (Megatron reduces grads in fp32),
    and the sharded optimizer state (an fp32 master for bf16 params, and at least one fp32 moment)."""
    h, heads, groups, ffn = args.hidden_size, args.num_attention_heads, args.num_query_groups, args.ffn_hidden_size
    head_dim = h // heads
    layer = h * (heads + 2 * groups) * head_dim + heads * head_dim * h + 3 * h * ffn + 2 * h  # SwiGLU MLP
    params = args.num_layers * layer + 2 * args.vocab_size * h + h  # untied embedding and output layer
    per_rank = params // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    dp = max(int(os.environ.get("WORLD_SIZE", 1)) // (args.tensor_model_parallel_size
                                                        * args.pipeline_model_parallel_size), 1)
    optimizer = (4 if args.bf16 else 0) + 4
    return per_rank * ((2 if args.bf16 else 4) + 4) + per_rank * optimizer // dp


def _check_memory(p, args) -> None:
    """Lower bounds, against the memory this rank can have: the model state (``model_state_bytes``)
    and what one micro-batch adds (the attention scores of one layer, unfused, in fp32). Catches
    absurd sizes before the kernel's OOM killer does (a SIGKILL with no message)."""
    available = _available_bytes()
    state = model_state_bytes(args)
    if available and state > available:
        p.error(f"the model (--num-layers {args.num_layers}, --hidden-size {args.hidden_size}, --ffn-hidden-size "
                f"{args.ffn_hidden_size}, --vocab-size {args.vocab_size}) needs at least {state / 2**30:.1f} GiB per rank "
                f"for its params, grads and optimizer state, more than the {available / 2**30:.1f} GiB this rank has: "
                "make it smaller, or split it (--tensor-model-parallel-size, --pipeline-model-parallel-size, more "
                "ranks)")
    windows = args.eval_iters * args.global_batch_size * (args.seq_length + 1) * 8  # int64, built once
    if available and windows > available:
        p.error(f"--eval-iters {args.eval_iters} x --global-batch-size {args.global_batch_size} validation windows of "
                f"--seq-length {args.seq_length} + 1 tokens need {windows / 2**30:.1f} GiB, more than the "
                f"{available / 2**30:.1f} GiB this rank has: lower --eval-iters")
    scores = args.micro_batch_size * (args.num_attention_heads // args.tensor_model_parallel_size) \
        * args.seq_length ** 2 * 4
    if available and scores > available:
        p.error(f"--seq-length {args.seq_length} with --micro-batch-size {args.micro_batch_size} and "
                f"--num-attention-heads {args.num_attention_heads} needs at least {scores / 2**30:.1f} GiB for one "
                f"layer's attention scores, more than the {available / 2**30:.1f} GiB this rank has: lower "
                "--seq-length or --micro-batch-size")


def _available_bytes():
    try:
        if torch.cuda.is_available():
            return torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", 0)))[0]
        import psutil

        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        return psutil.virtual_memory().available // max(ranks, 1)
    except Exception:  # noqa: BLE001 - no bound rather than a wrong one
        return None
