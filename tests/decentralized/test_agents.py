"""4 gloo ranks (one agent each) follow exactly the simulator's trajectory; megatron-core works too.

One spawn of 4 ranks (module-scoped fixture) runs every case; the parent process re-runs each
case in the single-process simulator and compares.
"""
import os

import pytest
import torch

from megatron_dmuon.decentralized.demuon import DecentralizedConfig, FlatLayout
from megatron_dmuon.decentralized.topology import make_topology, ring_graph
from megatron_dmuon.decentralized.simulator import DecentralizedSimulator, vmapped_loss_and_grad
from megatron_dmuon.testing.multiproc import run_distributed

HERE = os.path.dirname(__file__)
WORLD = 4
STEPS = 5
GRAPHS = ("complete", "ring", "directed_exponential")
METHODS = ("demuon", "demuon_a", "dsgd", "dsgd_c", "dsgd_n")
MEGATRON_STEPS = 4


def make_config(method):
    # float64 NS for DeMuon (exercises the NS path without bf16 rounding), exact SVD for DeMuon-A
    return DecentralizedConfig(
        method=method,
        lr=0.05,
        momentum=0.8,
        orthogonalizer="svd" if method == "demuon_a" else "newton_schulz",
        ns_dtype=torch.float64,
        clip_scale=0.3,
        extrapolation_points=2,
    )


def make_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def agent_batch(agent, step):
    """Heterogeneous local data: each agent regresses onto its own random teacher."""
    teacher = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + agent))
    x = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1000 * agent + step))
    return x, torch.tanh(x @ teacher)


def mse(out, target):
    return ((out - target) ** 2).mean()


# ------------------------------------------------------------------- code run on each rank
def rank_worker(rank, world_size):
    from megatron_dmuon.decentralized.agents import DecentralizedOptimizer

    out = {"plain": {}}
    for graph in GRAPHS:
        for method in METHODS:
            model = make_mlp()
            opt = DecentralizedOptimizer(model.named_parameters(), make_config(method), make_topology(graph, world_size))
            for step in range(STEPS):
                x, y = agent_batch(rank, step)

                def closure():
                    loss = mse(model(x), y)
                    loss.backward()
                    return loss

                if method == "demuon_a":
                    opt.step(closure)
                else:
                    closure()
                    opt.step()
                opt.zero_grad()
            out["plain"][(graph, method)] = {
                "params": opt.flat.detach().clone(),
                "consensus": opt.consensus_error(),
                "stationarity": opt.stationarity_proxy(),
                "module_sees_update": torch.equal(model[0].weight.detach().reshape(-1), opt.flat[0, :48]),
                "all_gather": opt.mixer.use_all_gather,
            }
    model = make_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        DecentralizedOptimizer(model.parameters(), make_config("demuon"), ring_graph(world_size + 4))
        out["mismatch_error"] = None
    except ValueError as exc:
        out["mismatch_error"] = str(exc)
    out["untouched_after_error"] = all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    out["megatron"] = megatron_worker(rank, world_size)
    return out


def megatron_worker(rank, world_size):
    """A megatron-core GPTModel without DDP: each DP rank is an agent, DeMuon mixes over the DP group."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt, causal_batch
    from megatron_dmuon.decentralized.agents import DecentralizedOptimizer

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    shape = GPTShape(num_layers=1, hidden_size=32, ffn_hidden_size=64, vocab_size=64, seq_length=16)
    model = build_gpt(shape)
    group = parallel_state.get_data_parallel_group()
    cfg = DecentralizedConfig(method="demuon", lr=0.02, momentum=0.8, ns_dtype=torch.float32)
    opt = DecentralizedOptimizer(model.named_parameters(), cfg, ring_graph(world_size), group=group, broadcast_from=0)
    initial = opt.flat.detach().clone()
    tokens = torch.randint(0, shape.vocab_size, (4, shape.seq_length + 1), generator=torch.Generator().manual_seed(rank))
    grads, params, losses = [], [], []
    for _ in range(MEGATRON_STEPS):
        batch = causal_batch(tokens)
        mask = batch.pop("loss_mask")
        loss = (model(**batch).float() * mask).sum() / mask.sum()
        loss.backward()
        grads.append(opt._flat_grad().clone())
        opt.step()
        opt.zero_grad()
        params.append(opt.flat.detach().clone())
        losses.append(float(loss))
    parallel_state.destroy_model_parallel()
    return {"initial": initial, "grads": grads, "params": params, "losses": losses, "names": opt.names,
            "shapes": [tuple(p.shape) for p in opt.params]}


# ------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def rank_results():
    return run_distributed("test_agents:rank_worker", WORLD, sys_path=[HERE], timeout=300)


def simulate(graph, method):
    model = make_mlp()
    names_shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    layout = FlatLayout(names_shapes)
    x0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sim = DecentralizedSimulator(make_config(method), make_topology(graph, WORLD), layout, x0)
    loss_and_grad = vmapped_loss_and_grad(model, layout, mse)
    for step in range(STEPS):
        batches = [agent_batch(a, step) for a in range(WORLD)]
        inputs = torch.stack([b[0] for b in batches])
        targets = torch.stack([b[1] for b in batches])
        sim.step(lambda pts: loss_and_grad(pts, inputs, targets)[1])
    return sim


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("method", METHODS)
def test_multiprocess_equals_simulator(rank_results, graph, method):
    sim = simulate(graph, method)
    for rank in range(WORLD):
        got = rank_results[rank]["plain"][(graph, method)]
        assert got["module_sees_update"]
        assert got["all_gather"] == (graph == "complete")
        assert torch.allclose(got["params"][0], sim.params[rank], atol=1e-12, rtol=1e-10), (graph, method, rank)
        assert got["consensus"] == pytest.approx(sim.consensus_errors()[0], rel=1e-9, abs=1e-14)
        assert got["stationarity"] == pytest.approx(sim.stationarity_proxies()[0], rel=1e-9)
    start = torch.cat([p.detach().reshape(-1) for p in make_mlp().parameters()])
    assert (sim.params - start).abs().max() > 1e-3  # the run really moved


def test_agent_count_mismatch_is_a_clear_error(rank_results):
    for r in rank_results:
        assert "has 8 agents but the process group has 4 ranks" in r["mismatch_error"]
        assert r["untouched_after_error"]


def test_megatron_core_gpt_trains_and_replays_in_simulator(rank_results):
    meg = [r["megatron"] for r in rank_results]
    for r in meg:
        assert torch.equal(r["initial"], meg[0]["initial"])  # broadcast_from=0
        assert r["losses"][-1] < r["losses"][0] - 0.1, r["losses"]
    assert "output_layer.weight" in meg[0]["names"] and "decoder.final_layernorm.weight" in meg[0]["names"]
    layout = FlatLayout(list(zip(meg[0]["names"], meg[0]["shapes"])))
    cfg = DecentralizedConfig(method="demuon", lr=0.02, momentum=0.8, ns_dtype=torch.float32)
    sim = DecentralizedSimulator(cfg, ring_graph(WORLD), layout, meg[0]["initial"][0])
    for step in range(MEGATRON_STEPS):
        grads = torch.cat([r["grads"][step] for r in meg])
        sim.step(lambda pts: grads)
        ranks_params = torch.cat([r["params"][step] for r in meg])
        assert torch.allclose(sim.params, ranks_params, atol=1e-5, rtol=1e-5), step
    assert sim.consensus_errors()[0] > 1e-4  # heterogeneous batches: agents differ, yet mix

