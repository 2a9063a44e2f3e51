"""The frozen per-run plan (planning/plan.py): validated on construction, serialisable, the one
DMuon object on Megatron's DDP."""
import dataclasses
import re
from pathlib import Path

import pytest

from megatron_dmuon.planning.owner_layout import plan_owner_layout
from megatron_dmuon.planning.plan import DMuonPlan, MatrixRecord, merged_records

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_dmuon"


def _records():
    common = dict(buffer="dense/torch.float32/torch.float32", expert=False)
    return [
        MatrixRecord(name="w1", numel=64, local_shape=(8, 8), full_shape=(8, 8), use_muon=True,
                     reason="hidden weight matrix", pieces=((8, 8),), ns_methods=("auto",),
                     schedules=({"coefficients": "you", "steps": 5},), tp_method="gather", cost=1.0, **common),
        MatrixRecord(name="w2", numel=128, local_shape=(8, 16), full_shape=(8, 16), use_muon=True,
                     reason="hidden weight matrix", pieces=((8, 16),), ns_methods=("auto",),
                     schedules=({"coefficients": ((3.4445, -4.775, 2.0315),), "steps": 1},), tp_method="gather",
                     cost=2.0, **common),
        MatrixRecord(name="bias", numel=8, local_shape=(8,), full_shape=(8,), use_muon=False,
                     reason="a vector or a single row/column", **common),
    ]


def _plan(records=None, **kw):
    records = records or _records()
    layout = plan_owner_layout([r.param_item() for r in records], 2)
    layouts = {records[0].buffer: layout}
    return DMuonPlan(records=merged_records(records, layouts), layouts=layouts, settings={"mode": "dmuon"}, **kw)


def test_plan_round_trips_through_json_and_is_frozen():
    plan = _plan(publish_dtype="fp8_e4m3")
    again = DMuonPlan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()
    assert {r.name for r in plan.matrices()} == {"w1", "w2"} and plan.record("w2").dp_owner in (0, 1)
    assert plan.describe().endswith("2 Muon matrices, 1 AdamW params, 1 buffers")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.publish_dtype = "param"
    with pytest.raises(ValueError, match="format"):
        DMuonPlan.from_json(plan.to_json().replace('"format": 1', '"format": 99'))


def test_an_inconsistent_plan_is_refused_on_construction():
    good = _plan()
    wrong_owner = [dataclasses.replace(r, dp_owner=1 - r.dp_owner) if r.name == "w1" else r for r in good.records]
    with pytest.raises(ValueError, match="w1: DP owner differs"):
        DMuonPlan(records=wrong_owner, layouts=good.layouts, settings={})
    no_schedule = [dataclasses.replace(r, schedules=()) if r.name == "w2" else r for r in good.records]
    with pytest.raises(ValueError, match="w2: pieces, NS methods and schedules"):
        DMuonPlan(records=no_schedule, layouts=good.layouts, settings={})
    with pytest.raises(ValueError, match="layout and records differ"):
        DMuonPlan(records=good.records[:2], layouts=good.layouts, settings={})
    with pytest.raises(ValueError, match="numel|spans"):  # a record that does not fit its place in the layout
        DMuonPlan(records=[dataclasses.replace(r, numel=r.numel + 1) if r.name == "bias" else r
                           for r in good.records], layouts=good.layouts, settings={})


def test_no_dmuon_state_is_set_on_megatron_objects_but_the_plan():
    """The plan is the only DMuon object on the DDP; the one other attribute set on a Megatron
    object is the two-level buffer's shard index (docs/architecture.md says why)."""
    allowed = {"dmuon_plan", "dmuon_shard_index"}
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "testing" in path.parts:
            continue
        for m in re.finditer(r"\.(_?dmuon_\w+)\s*=(?!=)", path.read_text()):
            found.setdefault(m.group(1), set()).add(path.relative_to(PACKAGE).as_posix())
        for m in re.finditer(r"setattr\([^,]+,\s*[\"'](_?dmuon_\w+)", path.read_text()):
            found.setdefault(m.group(1), set()).add(path.relative_to(PACKAGE).as_posix())
    assert set(found) <= allowed, {k: v for k, v in found.items() if k not in allowed}


def use_muon_false_run(rank, world_size):
    """One DMuon step of a real megatron-core GPT whose layer-0 fc2 Megatron marked use_muon=False."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt, train_step, wire_sync_funcs
    from megatron_dmuon.megatron.ddp import build_dmuon_ddp
    from megatron_dmuon.megatron.optimizer import get_dmuon_optimizer
    from megatron_dmuon.testing.workers import init_parallel

    init_parallel()
    model = build_gpt(GPTShape(num_layers=1))
    name = next(n for n, _ in model.named_parameters() if n.endswith("linear_fc2.weight"))
    marked = dict(model.named_parameters())[name]
    marked.use_muon = False  # as Megatron marks e.g. Mamba's in_proj
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = build_dmuon_ddp(model.config, ddp_config, model)
    wire_sync_funcs([ddp], ddp_config)
    opt = get_dmuon_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp])
    tokens = torch.randint(0, 256, (2, 33))
    _, _, _, ok = train_step([ddp], opt, [tokens], 32, 2)
    inner = opt.chained_optimizers[0].optimizer
    main_of = {m: s for mg, sg in zip(opt.chained_optimizers[0].model_float16_groups + opt.chained_optimizers[0].model_fp32_groups,
                                      opt.chained_optimizers[0].shard_fp32_from_float16_groups + opt.chained_optimizers[0].shard_fp32_groups)
               for m, s in zip(mg, sg)}
    record = ddp.dmuon_plan.record(name)
    return {"ok": ok, "use_muon": record.use_muon, "reason": record.reason,
            "state": sorted(inner.state[main_of[marked]]), "registered": main_of[marked] in inner.matrix_info,
            "summary": ddp.dmuon_plan.routing_summary()}


def test_a_use_muon_false_matrix_steps_by_adamw_and_the_routing_is_logged():
    from megatron_dmuon.testing.multiproc import run_distributed

    out = run_distributed("test_plan:use_muon_false_run", 1, sys_path=[str(Path(__file__).parent)], timeout=300)[0]
    assert out["ok"] and not out["use_muon"] and out["reason"] == "Megatron marks it use_muon=False"
    assert not out["registered"] and {"exp_avg", "exp_avg_sq"} <= set(out["state"])
    assert "momentum_buffer" not in out["state"]
    assert "1 Megatron marks it use_muon=False" in out["summary"] and "to Muon: " in out["summary"]


# ------------------------------------------------------------------ the NS each stack runs
def _muon_record(name, pieces, owner, requested="auto", tp_method="gather", expert=False):
    from megatron_dmuon.planning.plan import MatrixRecord

    numel = sum(p[0] * p[1] if len(p) == 2 else p[0] * p[1] * p[2] for p in pieces)
    return MatrixRecord(name=name, buffer="dense/torch.float32/torch.float32", expert=expert, numel=numel,
                        local_shape=(numel,), full_shape=(numel // pieces[0][-1], pieces[0][-1]), use_muon=True,
                        reason="hidden weight matrix", pieces=tuple(pieces), ns_methods=(requested,) * len(pieces),
                        schedules=({"coefficients": "you", "steps": 5},) * len(pieces), tp_method=tp_method,
                        dp_owner=owner)


def test_the_ns_of_every_piece_is_chosen_from_the_records_for_its_owners_stack():
    """planning.ns_choice.plan_ns_choices: each piece's request and schedule as its record holds them,
    for the stack its owner forms (owner = dense/expert part, DP owner, TP owner; a [heads, r, c] piece
    takes one slot per head). 'auto' on CUDA reads the autotune lookup with that batch, else counts
    FLOPs; off CUDA it is standard NS; distributed Gram NS runs Gram NS whatever was asked."""
    import torch

    from megatron_dmuon.planning.ns_choice import NSResolver, owner_stack_batches, plan_ns_choices

    records = [_muon_record("a", [(512, 3584)], owner=0), _muon_record("b", [(512, 3584), (512, 3584)], owner=0),
               _muon_record("c", [(4, 512, 3584)], owner=1), _muon_record("d", [(512, 3584)], owner=0, expert=True),
               _muon_record("e", [(512, 512)], owner=1), _muon_record("f", [(64, 64)], owner=1, requested="standard",
                                                                       tp_method="distributed_gram")]
    assert owner_stack_batches([(512, 3584), (4, 512, 3584), (64, 64)]) == {(512, 3584): 5, (64, 64): 1}
    asked = []

    def measured(m, n, batch, dtype, steps):  # the stack of 3 is measured standard, the others not at all
        asked.append((m, n, batch, dtype, steps))
        return "standard" if batch == 3 else None

    choices = plan_ns_choices(records, NSResolver("auto", torch.bfloat16, on_cuda=True, measured=measured))
    assert [[c.method for c in cs] for cs in choices] == [["standard"], ["standard", "standard"], ["gram"], ["gram"],
                                                          ["standard"], ["gram"]]
    assert sorted(set(asked)) == [(512, 512, 1, torch.bfloat16, 5), (512, 3584, 1, torch.bfloat16, 5),
                                  (512, 3584, 3, torch.bfloat16, 5), (512, 3584, 4, torch.bfloat16, 5)]
    gram = choices[2][0]
    assert (gram.compute_dtype, gram.runs, gram.label("you")) == (torch.float16, "gram", "gram float16 you x5")
    assert choices[5][0].runs == "standard"  # a 64 x 64 Gram request runs standard NS inside the NS entry points
    off_cuda = plan_ns_choices(records, NSResolver("auto", torch.bfloat16, on_cuda=False, measured=measured))
    assert {c.method for cs in off_cuda[:5] for c in cs} == {"standard"}
    with pytest.raises(ValueError, match="NS method 'svd' unknown"):  # (the flag's words: the config's check)
        plan_ns_choices([_muon_record("x", [(8, 8)], owner=0, requested="svd")], NSResolver(on_cuda=False))


def test_the_owner_step_runs_the_choice_its_matrix_info_carries():
    """The runtime decides nothing the plan decided: a matrix whose MatrixInfo carries a Gram choice runs
    Gram NS although the settings ask for standard NS (what it ran is in ns_paths), and its update equals
    the Gram NS of its momentum; a matrix decided by ``with_ns_choices`` runs what the settings ask, and one
    with no choice at all is refused at registration (the step never decides)."""
    import torch

    from megatron_dmuon.algorithms.ns_dispatch import orthogonalize
    from megatron_dmuon.planning.ns_choice import choose_ns
    from megatron_dmuon.runtime.owner_step import MatrixInfo, MuonSettings, OwnerMuonAdamW, with_ns_choices

    settings = MuonSettings(ns_method="standard", ns_dtype=torch.float32, coefficients="you", momentum=0.0,
                            nesterov=False, scale_mode="none")
    wide, square = torch.nn.Parameter(torch.zeros(8, 64)), torch.nn.Parameter(torch.zeros(16, 16))
    choice = choose_ns(8, 64, 1, requested="gram", precision=torch.float32, schedule=settings.ns_schedule(8, 64),
                       on_cuda=False)
    opt = OwnerMuonAdamW([{"params": [wide, square], "use_muon": True}], lr=1.0, weight_decay=0.0, muon=settings)
    opt.register_matrix(wide, MatrixInfo("wide", (8, 64), ns=(choice,)))
    with pytest.raises(ValueError, match="matrix 'square' has no NS choice"):
        opt.register_matrix(square, MatrixInfo("square", (16, 16)))
    opt.register_matrix(square, with_ns_choices([MatrixInfo("square", (16, 16))], settings, "cpu")[0])
    grads = [torch.randn(8, 64, generator=torch.Generator().manual_seed(1)),
             torch.randn(16, 16, generator=torch.Generator().manual_seed(2))]
    wide.grad, square.grad = grads[0].clone(), grads[1].clone()
    opt.step()
    assert opt.ns_paths == {"8x64": "gram float32 you x5", "16x16": "standard float32 you x5"}
    kw = dict(coefficients="you", steps=5, compute_dtype=torch.float32, check_finite=False)
    assert torch.equal(wide.detach(), -orthogonalize(grads[0][None], method="gram", **kw)[0])
    assert torch.equal(square.detach(), -orthogonalize(grads[1][None], method="standard", **kw)[0])
