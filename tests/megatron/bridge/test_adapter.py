"""[bridge]: DMuon in Megatron-Bridge (megatron_dmuon/megatron/bridge/, imported as megatron_dmuon.bridge).

In CI (no Bridge installed): Bridge's OptimizerConfig fields map onto DMuon's config as the
Megatron-LM flags do, errors speak Bridge's field names, and the launcher's argument handling.
Where Megatron-Bridge is installed (launch/bridge/cpu_venv.sh makes such a CPU venv; there
testing/bridge_imports.py stands in for Transformer Engine and diffusers, which Bridge imports eagerly): Bridge's own ``setup_optimizer`` builds DMuon
through ``DMuonOptimizerConfig.provide`` on a model wrapped by megatron-core's ``_ddp_wrap`` (the
DDP class routed by ``finalize()``), and its steps equal, bit for bit, those of the optimizer built
directly by ``get_dmuon_optimizer`` (which the rest of the suite checks against the single-process
reference). Bridge's own train loop needs CUDA: the H200 run is bench/bridge.py (docs/bridge.md).
"""
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_dmuon.bridge import bridge_names
from megatron_dmuon.megatron.bridge.__main__ import split_argv
from megatron_dmuon.megatron.flags import dmuon_config_from_fields
from tests import ROOT


def _core_config(**kw):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(**kw)


def test_muon_fields_keep_their_meaning():
    """The muon_* fields a Bridge recipe sets (distributed_muon_with_cosine_annealing's) give the
    config the same flags give under Megatron-LM; DMuon's own options go by their flag's name."""
    cfg = dmuon_config_from_fields(_core_config(muon_momentum=0.95, muon_nesterov=True, muon_extra_scale_factor=0.2,
                                                muon_scale_mode="shape_scaling", muon_num_ns_steps=6,
                                                muon_fp32_matmul_prec="high", muon_split_qkv=False),
                                   ns_launch="graph", balance="numel_lpt")
    m = cfg.muon
    assert (m.momentum, m.nesterov, m.extra_scale, m.scale_mode, m.ns_steps) == (0.95, True, 0.2, "shape_scaling", 6)
    assert str(m.ns_dtype) == "torch.float32" and m.ns_launch == "graph" and cfg.layout.balance == "numel_lpt"
    assert cfg.split_qkv is False
    default = dmuon_config_from_fields(_core_config())
    assert default.muon.momentum == 0.95 and default.muon.nesterov is False  # megatron-core's own field defaults


def test_refusals_name_bridges_fields():
    from megatron_dmuon.megatron.megatron_lm_flags import UNKNOWN_MUON_FLAGS

    before = dict(UNKNOWN_MUON_FLAGS)
    with pytest.raises(ValueError, match="blockwise") as e:
        dmuon_config_from_fields(_core_config(muon_tp_mode="blockwise"), tensor_parallel_size=2)
    assert "optimizer.muon_tp_mode duplicated" in bridge_names(str(e.value))
    with pytest.raises(ValueError, match="--muon-scalar-optimizer lion"):
        dmuon_config_from_fields(_core_config(muon_scalar_optimizer="lion"))
    with pytest.raises(TypeError, match="unknown DMuon option 'ns_lunch'; valid: .*ns_launch"):
        dmuon_config_from_fields(_core_config(), ns_lunch="graph")
    assert dict(UNKNOWN_MUON_FLAGS) == before  # the Megatron-LM hook's table is left as it was
    assert bridge_names("drop --fp8-param-gather or --qk-clip; keep --no-such-field",
                        {"fp8_param_gather": "ddp", "qk_clip": "model"}) == \
        "drop ddp.fp8_param_gather or model.qk_clip; keep --no-such-field"
    assert bridge_names("pass --dmuon-ns-launch graph with --use-distributed-optimizer") == (
        "pass dmuon_options['ns_launch'] graph with ddp.use_distributed_optimizer and "
        "optimizer.use_distributed_optimizer")


def test_launcher_splits_dmuon_options_from_the_script():
    options, script, rest = split_argv(["--dmuon-ns-launch", "graph", "--dmuon-balance", "milp", "run_recipe.py",
                                        "--recipe", "x", "optimizer.optimizer=dmuon"])
    assert options == {"ns_launch": "graph", "balance": "milp"}
    assert script.endswith("run_recipe.py") and rest == ["--recipe", "x", "optimizer.optimizer=dmuon"]
    assert split_argv(["run.py"])[0] == {}
    with pytest.raises(SystemExit, match="only --dmuon-\\* flags go there"):
        split_argv(["--recipe", "x", "run.py"])
    with pytest.raises(SystemExit, match="no Python script given"):
        split_argv(["--dmuon-ns-launch", "graph"])
    with pytest.raises(SystemExit):  # argparse's own error: not a launch mode
        split_argv(["--dmuon-ns-launch", "fast", "run.py"])


BRIDGE_SCRIPT = textwrap.dedent("""
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    from megatron_dmuon.testing import bridge_imports
    bridge_imports.install()  # a CPU machine without Transformer Engine and diffusers
    from megatron_dmuon.testing import cpu_shim
    cpu_shim.install()
    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    import megatron.training.models.dist_utils as dist_utils
    from megatron.bridge.training.optim import setup_optimizer
    from megatron_dmuon.bridge import dmuon_with_cosine_annealing
    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt, train_step, wire_sync_funcs
    from megatron_dmuon.megatron.optimizer import get_dmuon_optimizer

    parallel_state.initialize_model_parallel(1, 1)
    opt_cfg, sched_cfg = dmuon_with_cosine_annealing(precision="fp32", lr_warmup_iters=1, lr_decay_iters=10,
                                                     max_lr=1e-2, min_lr=1e-3, muon_tp_mode="duplicated")
    opt_cfg.bf16, opt_cfg.params_dtype = False, torch.float32
    opt_cfg.finalize()  # what Bridge's ConfigContainer.validate() calls: routes the DDP wrap
    sched_cfg.lr_warmup_steps, sched_cfg.lr_decay_steps, sched_cfg.wd_incr_steps = 1, 10, 10
    assert dist_utils.DistributedDataParallel.__name__ == "BoundDMuonDDP"
    shape = GPTShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                     vocab_size=128, seq_length=32, bf16=False)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    runs = {}
    for how in ("bridge", "direct"):
        torch.manual_seed(0); model_parallel_cuda_manual_seed(0)
        chunks = dist_utils._ddp_wrap([build_gpt(shape)], False, ddp_config, False, pg_collection=pgs)
        wire_sync_funcs(chunks, ddp_config)
        assert chunks[0].dmuon_plan is not None
        if how == "bridge":
            opt, sched = setup_optimizer(opt_cfg, sched_cfg, chunks, pg_collection=pgs)
            lrs = lambda: sched.step(increment=4)
        else:
            opt = get_dmuon_optimizer(opt_cfg.megatron_core_config(), chunks, opt_cfg.dmuon_config())
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
            sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1,
                                            lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.033, end_wd=0.033,
                                            wd_incr_steps=10, wd_incr_style="constant")
            lrs = lambda: sched.step(increment=4)
        assert type(opt).__name__ == "DMuonChainedOptimizer", type(opt)
        torch.manual_seed(1)
        tokens = torch.randint(0, 128, (4, 33))  # one batch again and again: the loss must fall
        losses = []
        for _ in range(5):
            loss, _, _, ok = train_step(chunks, opt, [tokens[:2], tokens[2:]], 32, 2)
            assert ok
            lrs()
            losses.append(loss)
        runs[how] = (losses, {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()})
    assert runs["bridge"][0] == runs["direct"][0], runs
    assert all(torch.equal(runs["bridge"][1][k], runs["direct"][1][k]) for k in runs["direct"][1])
    assert runs["bridge"][0][-1] < runs["bridge"][0][0]
    print("BRIDGE OK", runs["bridge"][0])
""")


def _bridge_importable() -> bool:
    code = ("from megatron_dmuon.testing import bridge_imports; bridge_imports.install(); "
            "import megatron.bridge.training.optim")
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


NO_BRIDGE = "Megatron-Bridge is not installed here (CI); launch/bridge/cpu_venv.sh makes a CPU venv that has it"


@pytest.mark.skipif(not _bridge_importable(), reason=NO_BRIDGE)
def test_bridge_setup_optimizer_builds_dmuon_bit_for_bit(tmp_path):
    from megatron_dmuon.testing.multiproc import free_port

    script = tmp_path / "bridge_setup_optimizer.py"
    script.write_text(BRIDGE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0 and "BRIDGE OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


SWITCH_SCRIPT = textwrap.dedent("""
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    from megatron_dmuon.testing import bridge_imports
    bridge_imports.install()
    sys.path.insert(0, sys.argv[1])
    import types
    import bridge as bench  # bench/bridge.py: the ConfigContainer a Bridge user writes
    import megatron_dmuon.bridge as mb

    def config(optimizer="muon", **kw):
        args = types.SimpleNamespace(model="small", optimizer=optimizer, iters=10, seed=1, lr=1e-3, log_interval=1,
                                     save=None, save_interval=None, load=None, ckpt_step=None, dmuon_option=[], **kw)
        return bench.build_config(args)

    # use_dmuon keeps the recipe's settings and turns the distributed optimizer's buffers on
    cfg = config()
    assert cfg.optimizer.optimizer == "dist_muon" and not cfg.ddp.use_distributed_optimizer
    lr, momentum = cfg.optimizer.lr, cfg.optimizer.muon_momentum
    mb.use_dmuon(cfg, ns_launch="graph")
    assert type(cfg.optimizer).__name__ == "DMuonOptimizerConfig" and cfg.optimizer.optimizer == "dmuon"
    assert (cfg.optimizer.lr, cfg.optimizer.muon_momentum) == (lr, momentum) and cfg.ddp.use_distributed_optimizer
    assert cfg.optimizer.dmuon_options == {"ns_launch": "graph"}
    # refused by name, in Bridge's terms, before anything is built
    for change, message in ((lambda c: setattr(c.ddp, "use_megatron_fsdp", True), "drop ddp.use_megatron_fsdp"),
                            (lambda c: (setattr(c.optimizer, "muon_tp_mode", "blockwise"),
                                        setattr(c.model, "tensor_model_parallel_size", 2)), "optimizer.muon_tp_mode"),
                            (lambda c: setattr(c.optimizer, "muon_scalar_optimizer", "lion"),
                             "optimizer.muon_scalar_optimizer lion"),
                            # the optimizer build's own start-up checks, run by use_dmuon before any model exists
                            (lambda c: setattr(c.model, "context_parallel_size", 2), "model.context_parallel_size > 1"),
                            (lambda c: setattr(c.optimizer, "overlap_param_gather_with_optimizer_step", True),
                             "optimizer.overlap_param_gather_with_optimizer_step")):
        c = config()
        change(c)
        try:
            mb.use_dmuon(c)
        except ValueError as e:
            assert message in str(e), (message, str(e))
            assert type(c.optimizer).__name__ == "OptimizerConfig"  # unchanged
        else:
            raise AssertionError("not refused: " + message)
    # install(): Bridge's pretrain takes optimizer 'dmuon' (the override a run_recipe.py user writes)
    import megatron.bridge.training.pretrain as pretrain_module
    mb.install(ns_launch="graph")
    assert pretrain_module.pretrain.__name__ == "pretrain" and ("megatron.bridge.training.pretrain", "pretrain") in \\
        __import__("megatron_dmuon.megatron.bridge.adapter", fromlist=["_ORIGINALS"])._ORIGINALS
    c = config()
    c.optimizer.optimizer = "dmuon"
    try:
        pretrain_module.pretrain(c, lambda *a: None)  # stops at Bridge's CUDA set-up on a CPU machine
    except BaseException:
        pass
    assert type(c.optimizer).__name__ == "DMuonOptimizerConfig" and c.optimizer.dmuon_options == {"ns_launch": "graph"}
    print("SWITCH OK")
""")


@pytest.mark.skipif(not _bridge_importable(), reason=NO_BRIDGE)
def test_use_dmuon_install_and_refusals_on_a_real_config_container(tmp_path):
    script = tmp_path / "bridge_switch.py"
    script.write_text(SWITCH_SCRIPT)
    bench = os.path.join(ROOT, "bench")
    proc = subprocess.run([sys.executable, str(script), bench], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0 and "SWITCH OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


CHECKPOINT_SWITCH_SCRIPT = """import os, sys, warnings
warnings.filterwarnings("ignore")
from megatron_dmuon.testing import bridge_imports
bridge_imports.install()  # a CPU machine without Transformer Engine and diffusers
from megatron_dmuon.testing import cpu_shim
cpu_shim.install()


def main():
    import types
    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    root, bench_dir = sys.argv[2], sys.argv[3]
    sys.path.insert(0, bench_dir)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    import megatron.training.models.dist_utils as dist_utils
    from megatron.bridge.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.bridge.training.state import GlobalState
    import bridge as bench  # bench/bridge.py: the ConfigContainer a Bridge user writes
    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt, train_step, wire_sync_funcs

    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    init_num_microbatches_calculator(0, None, 4, 2, 1)  # (Bridge's set-up makes it; its load updates it)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    shape = GPTShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                     vocab_size=128, seq_length=32, bf16=True)
    torch.manual_seed(1)
    batches = [torch.randint(0, 128, (4, 33)) for _ in range(6)]


    def config(optimizer, **ckpt):
        args = types.SimpleNamespace(model="small", optimizer=optimizer, iters=10, seed=1, lr=1e-2, log_interval=1,
                                     save=None, save_interval=None, load=None, ckpt_step=None,
                                     dmuon_option=["ns_method=standard"])
        cfg = bench.build_config(args)
        cfg.optimizer.muon_fp32_matmul_prec = "high"  # fp32 NS on both sides: they then agree to rounding
        cfg.optimizer.bf16, cfg.optimizer.params_dtype = True, torch.bfloat16
        for k, v in ckpt.items():
            setattr(cfg.checkpoint, k, v)
        cfg.checkpoint.save_rng = cfg.checkpoint.load_rng = False
        cfg.scheduler.lr_warmup_steps, cfg.scheduler.lr_decay_steps, cfg.scheduler.wd_incr_steps = 4, 40, 40  # (validate())
        return cfg


    def build(cfg):
        cfg.optimizer.finalize()
        torch.manual_seed(0); model_parallel_cuda_manual_seed(0)
        chunks = dist_utils._ddp_wrap([build_gpt(shape)], False, cfg.ddp, False, pg_collection=pgs)
        wire_sync_funcs(chunks, cfg.ddp)
        opt, sched = setup_optimizer(cfg.optimizer, cfg.scheduler, chunks, pg_collection=pgs)
        state = GlobalState()
        state.cfg = cfg
        return chunks, opt, sched, state


    def train(chunks, opt, sched, steps):
        losses = []
        for step in steps:
            loss, _, _, ok = train_step(chunks, opt, [batches[step][:2], batches[step][2:]], 32, 2)
            assert ok
            sched.step(increment=4)
            losses.append(loss)
        return losses


    def momenta(opt, chunks):
        # {param name: Muon momentum (fp32, flat)} of either optimizer (whole matrices: DP = 1)
        names = {p: n for n, p in chunks[0].module.named_parameters()}
        out = {}
        for part in getattr(opt, "chained_optimizers", [opt]):
            inner = part.optimizer
            pairs = []
            for models, mains in (("float16_groups", "fp32_from_float16_groups"),
                                  ("model_float16_groups", "shard_fp32_from_float16_groups")):
                if hasattr(part, models):
                    pairs += [(m, s) for mg, sg in zip(getattr(part, models), getattr(part, mains)) for m, s in zip(mg, sg)]
            for model, main in pairs:
                buf = inner.state.get(main, {}).get("momentum_buffer")
                if buf is not None:
                    out[names[model]] = buf.detach().float().reshape(-1).clone()
        return out


    # Bridge's LayerWise Muon (distributed_muon_with_cosine_annealing, no distributed optimizer, as its Kimi-K2 recipe)
    lw_cfg = config("muon", save=root, save_interval=3)
    assert lw_cfg.optimizer.optimizer == "dist_muon"
    chunks, opt, sched, state = build(lw_cfg)
    assert "LayerWise" in str([type(p).__name__ for p in opt.chained_optimizers]) or "LayerWise" in type(opt).__name__, type(opt)
    never = train(chunks, opt, sched, range(3))
    state.train_state.step = 3
    save_checkpoint(state, chunks, opt, sched, 0, checkpointing_context={})
    at_save = momenta(opt, chunks)
    assert at_save, "no Muon momenta in Bridge's LayerWise optimizer"
    never += train(chunks, opt, sched, range(3, 6))

    # DMuon loads it in Bridge's own load and trains on
    dm_cfg = config("dmuon", load=root)
    chunks, opt, sched, state = build(dm_cfg)
    assert type(opt).__name__ == "DMuonChainedOptimizer", type(opt)
    iteration, _ = load_checkpoint(state, chunks, opt, sched, checkpointing_context={})
    assert iteration == 3, iteration
    loaded = momenta(opt, chunks)
    assert set(loaded) == set(at_save), (sorted(loaded), sorted(at_save))
    assert all(torch.equal(loaded[n], at_save[n]) for n in at_save), "momenta differ after the load"
    switched = train(chunks, opt, sched, range(3, 6))
    print("losses never switched", never[3:], "switched", switched)
    assert switched[0] == never[3]  # the loaded model, bit-equal
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(switched, never[3:]))

    # and back: the DMuon run saves at 6, Bridge's LayerWise Muon loads it and trains on
    dm_cfg.checkpoint.save = root + "_dmuon"
    state.train_state.step = 6
    save_checkpoint(state, chunks, opt, sched, 0, checkpointing_context={})
    dmuon_at_save = momenta(opt, chunks)
    dmuon_next = train(chunks, opt, sched, range(3, 5))  # (the batches of steps 3-4 again: data is not the point)
    back_cfg = config("muon", load=root + "_dmuon")
    from megatron_dmuon.megatron.bridge.adapter import restore_ddp
    restore_ddp()  # a second run in this process (install()'s pretrain does this for a non-DMuon config)
    chunks, opt, sched, state = build(back_cfg)
    iteration, _ = load_checkpoint(state, chunks, opt, sched, checkpointing_context={})
    assert iteration == 6, iteration
    back = momenta(opt, chunks)
    assert set(back) == set(dmuon_at_save) and all(torch.equal(back[n], dmuon_at_save[n]) for n in back)
    back_next = train(chunks, opt, sched, range(3, 5))
    print("losses DMuon on", dmuon_next, "LayerWise from DMuon's checkpoint", back_next)
    assert back_next[0] == dmuon_next[0]
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(back_next, dmuon_next))
    print("BRIDGE SWITCH OK", len(at_save), "momenta")


if __name__ == "__main__":
    main()
"""


@pytest.mark.skipif(not _bridge_importable(), reason=NO_BRIDGE)
def test_optimizer_switch_through_bridges_own_checkpointing(tmp_path):
    """Bridge's LayerWise Muon (its distributed_muon_with_cosine_annealing, no distributed optimizer, as its
    Kimi-K2 recipe) trains 3 steps and saves with Bridge's save_checkpoint; a DMuon run loads it with
    Bridge's load_checkpoint (routed by DMuonOptimizerConfig.finalize) and trains on: its Muon momenta are
    the saved ones bit for bit, its first loss is the never-switched run's, the next agree within 1e-4
    (fp32 NS on both sides, bf16 model). And back: DMuon's checkpoint into Bridge's LayerWise Muon, the
    same checks. Without the route the first load fails (a KeyError on Megatron's master names)."""
    from megatron_dmuon.testing.multiproc import free_port

    script = tmp_path / "bridge_checkpoint_switch.py"
    script.write_text(CHECKPOINT_SWITCH_SCRIPT)
    bench = os.path.join(ROOT, "bench")
    proc = subprocess.run([sys.executable, str(script), str(free_port()), str(tmp_path / "ckpt"), bench],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0 and "BRIDGE SWITCH OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
