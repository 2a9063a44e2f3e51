"""The owner step (OwnerMuonAdamW: batched by shape, no megatron) in every configuration, against
the torch-verified rule: torch.optim.Muon / torch.optim.AdamW where torch has the setting, else
``muon_step_`` (itself checked bitwise against torch.optim.Muon in tests/algorithms/test_muon.py)."""
import pytest
import torch

from megatron_dmuon.algorithms.muon import muon_step_
from megatron_dmuon.algorithms.splitting import SplitRule
from megatron_dmuon.runtime.owner_step import MatrixInfo, MuonSettings, OwnerMuonAdamW, with_ns_choices

SHAPES = [(48, 32), (48, 32), (32, 48), (40, 40)]  # two of one shape: batched into one NS call


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _owner(params, settings, lr=0.02, wd=0.1, adam=()):
    groups = [{"params": params, "use_muon": True}]
    if adam:
        groups.append({"params": list(adam), "use_muon": False})
    opt = OwnerMuonAdamW(groups, lr=lr, weight_decay=wd, muon=settings)
    infos = with_ns_choices([MatrixInfo(f"w{i}", tuple(p.shape)) for i, p in enumerate(params)], settings, "cpu")
    for p, info in zip(params, infos):
        opt.register_matrix(p, info)
    return opt


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("scale_mode,torch_fn", [("shape_scaling", "original"), ("match_rms_adamw", "match_rms_adamw")])
def test_owner_step_equals_torch_optim_muon_and_adamw(nesterov, scale_mode, torch_fn):
    starts = [_rand(*s, seed=i) for i, s in enumerate(SHAPES)]
    vec = _rand(32, seed=99)
    ours = [torch.nn.Parameter(s.clone()) for s in starts]
    ours_vec = torch.nn.Parameter(vec.clone())
    theirs = [torch.nn.Parameter(s.clone()) for s in starts]
    theirs_vec = torch.nn.Parameter(vec.clone())
    settings = MuonSettings.torch_muon(momentum=0.9, nesterov=nesterov, scale_mode=scale_mode, ns_dtype=torch.bfloat16)
    opt = _owner(ours, settings, adam=[ours_vec])
    ref = [torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=torch_fn),
           torch.optim.AdamW([theirs_vec], lr=0.02, weight_decay=0.1)]
    for step in range(6):
        grads = [_rand(*s, seed=100 * step + i) for i, s in enumerate(SHAPES)] + [_rand(32, seed=7 + step)]
        for p, g in zip(ours + [ours_vec], grads):
            p.grad = g.clone()
        for p, g in zip(theirs + [theirs_vec], grads):
            p.grad = g.clone()
        opt.step()
        for o in ref:
            o.step()
    assert opt.stats["ns_calls"] == 3 and opt.stats["ns_matrices"] == 4  # one batched call per shape
    for a, b, s in zip(ours + [ours_vec], theirs + [theirs_vec], starts + [vec]):
        assert float((a - b).abs().max()) <= 1e-6
        assert float((a - s).abs().max()) > 1e-3  # really moved


@pytest.mark.parametrize("settings", [
    MuonSettings(scale_mode="none", extra_scale=3.0, ns_dtype=torch.float32),
    MuonSettings(ns_method="gram", ns_dtype=torch.float32, coefficients="polar_express"),
    MuonSettings(nesterov=False, scale_mode="match_rms_adamw", extra_scale=0.5, ns_dtype=torch.float32,
                 coefficients="you"),
], ids=["none_extra3", "gram_fp32", "no_nesterov_rms_you"])
def test_owner_step_equals_muon_step_in_other_configurations(settings):
    starts = [_rand(*s, seed=i) for i, s in enumerate(SHAPES)]
    ours = [torch.nn.Parameter(s.clone()) for s in starts]
    singles, moms = [s.clone() for s in starts], [torch.zeros(s.shape) for s in starts]
    opt = _owner(ours, settings, lr=0.01, wd=0.05)
    for step in range(4):
        grads = [_rand(*s, seed=10 * step + i) for i, s in enumerate(SHAPES)]
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        for p, m, g in zip(singles, moms, grads):
            muon_step_(p, g, m, lr=0.01, beta=settings.momentum, nesterov=settings.nesterov, weight_decay=0.05,
                       scale_mode=settings.scale_mode, extra_scale=settings.extra_scale, ns_method=settings.ns_method,
                       coefficients=settings.coefficients, steps=settings.ns_steps, compute_dtype=settings.ns_dtype)
    for a, b in zip(ours, singles):
        assert float((a - b).abs().max()) <= 2e-6


@pytest.mark.parametrize("rule", [
    SplitRule("qkv", num_attention_heads=4, num_query_groups=2, head_dim=8),
    SplitRule("qkv", per_head=True, num_attention_heads=4, num_query_groups=2, head_dim=8),
    SplitRule("glu"),
], ids=["qkv", "heads", "glu"])
def test_split_matrix_is_muon_on_every_piece(rule):
    # a split matrix steps like independent Muon matrices, one per piece (each with its own lr scale)
    shape = (64, 24) if rule.kind == "qkv" else (40, 24)
    start = _rand(*shape)
    ours = torch.nn.Parameter(start.clone())
    settings = MuonSettings.torch_muon(ns_dtype=torch.float32, scale_mode="match_rms_adamw")
    opt = OwnerMuonAdamW([{"params": [ours], "use_muon": True}], lr=0.02, weight_decay=0.1, muon=settings)
    opt.register_matrix(ours, with_ns_choices([MatrixInfo("w", shape, rule)], settings, "cpu")[0])
    pieces = [p.clone() for p in rule.pieces(start)]
    flat = [m for p in pieces for m in (p if p.dim() == 3 else [p])]
    moms = [torch.zeros_like(m) for m in flat]
    for step in range(3):
        g = _rand(*shape, seed=step + 1)
        ours.grad = g.clone()
        opt.step()
        g_flat = [m for p in rule.pieces(g) for m in (p if p.dim() == 3 else [p])]
        for p, m, gp in zip(flat, moms, g_flat):
            muon_step_(p, gp.contiguous(), m, lr=0.02, weight_decay=0.1, scale_mode="match_rms_adamw",
                       compute_dtype=torch.float32)
    it = iter(flat)
    rebuilt = rule.assemble([torch.stack([next(it) for _ in range(p.shape[0])]) if p.dim() == 3 else next(it)
                             for p in pieces], like=start)
    assert float((ours.detach() - rebuilt).abs().max()) <= 2e-6


def test_muon_refuses_vectors_columns_and_nd_tensors():
    opt = OwnerMuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "use_muon": False}], lr=0.1,
                         weight_decay=0.0)
    for shape in [(8,), (8, 1), (1, 8), (2, 3, 4)]:
        with pytest.raises(ValueError, match="AdamW"):
            MatrixInfo("bad", shape)
    with pytest.raises(RuntimeError, match="whole matrices"):
        opt.register_matrix(torch.zeros(12), MatrixInfo("w", (4, 4)))


def test_stack_plan_places_whole_and_glu_matrices_as_views_and_copies_other_splits():
    from megatron_dmuon.runtime.ns_stacks import StackJob, StackPlan

    qkv = SplitRule("qkv", num_attention_heads=4, num_query_groups=2, head_dim=8)
    heads = SplitRule("qkv", per_head=True, num_attention_heads=4, num_query_groups=2, head_dim=8)
    jobs = [StackJob("w", (32, 24)), StackJob("fc1", (64, 24), SplitRule("glu")), StackJob("qkv", (64, 24), qkv),
            StackJob("heads", (64, 24), heads), StackJob("v", (32, 24))]
    plan = StackPlan(jobs)
    assert sorted(plan.direct) == [0, 1, 4]  # whole matrices and the untangled GLU halves
    stacks = plan.new_stacks("cpu")
    matrices = [_rand(*j.shape, seed=i) for i, j in enumerate(jobs)]
    for j, m in enumerate(matrices):
        view = plan.direct_view(stacks, j)
        if view is not None:
            view.copy_(m)  # written through the view: lands in the stack
        else:
            plan.write(stacks, j, m)
    for j, (job, m) in enumerate(zip(jobs, matrices)):
        expected = [m] if job.split is None else job.split.pieces(m)
        got = plan.outputs(stacks, j)
        assert [tuple(g.shape) for g in got] == [tuple(e.shape) for e in expected]
        assert all(torch.equal(g, e) for g, e in zip(got, expected))
        if j in plan.direct:
            assert plan.direct_view(stacks, j).data_ptr() == stacks[plan.direct[j][0]][plan.direct[j][1]].data_ptr()
    # one stack per piece shape, slots in job order (a direct matrix's row blocks consecutive)
    sizes = {(m, n): b for b, m, n in plan.stack_shapes()}
    assert sizes == {(32, 24): 1 + 2 + 1 + 1, (16, 24): 2, (8, 24): 8}  # w, gate+up, q, v | k, v | heads
    assert plan.direct[1] == (0, 1, 2)


@pytest.mark.parametrize("ns_method", ["standard", "gram"])
def test_local_step_is_bit_identical_to_the_exchange_path(ns_method):
    # TP = 1 runs _local_step (updates written into the NS stacks, directions applied from them);
    # the general TP path (_exchange_step) materialises, stacks and reassembles: same bits
    rules = [None, SplitRule("glu"), SplitRule("qkv", num_attention_heads=4, num_query_groups=2, head_dim=8),
             SplitRule("qkv", per_head=True, num_attention_heads=4, num_query_groups=2, head_dim=8), None,
             SplitRule("glu", tp_shards=2), SplitRule("experts", num_experts=2, split_glu=True)]
    shapes = [(48, 32), (64, 24), (64, 24), (64, 24), (48, 32), (64, 24), (128, 24)]
    settings = MuonSettings(ns_dtype=torch.float32, ns_method=ns_method, scale_mode="match_rms_adamw",
                            coefficients="adaptive")
    runs = []
    for path in ("local", "exchange"):
        params = [torch.nn.Parameter(_rand(*s, seed=i)) for i, s in enumerate(shapes)]
        opt = OwnerMuonAdamW([{"params": params, "use_muon": True}], lr=0.02, weight_decay=0.1, muon=settings)
        infos = [MatrixInfo(f"w{i}", tuple(p.shape), rule) for i, (p, rule) in enumerate(zip(params, rules))]
        for p, info in zip(params, with_ns_choices(infos, settings, "cpu")):
            opt.register_matrix(p, info)
        if path == "exchange":  # with clipping as the TP path takes it: one foreach pass first
            def exchange(entries, grad_scale=None, opt=opt):
                if grad_scale is not None:
                    torch._foreach_mul_([p.grad for p, _, _ in entries], grad_scale)
                return opt._exchange_step(entries)

            opt._local_step = exchange
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = _rand(*p.shape, seed=100 * step + i)
            opt.grad_scale = 0.37 if step == 1 else None  # a clipped step
            opt.step()
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
