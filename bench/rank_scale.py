"""bench/rank_balance.py scale: the optimizer step and the iteration at each emulated layout.

Compute is what ``emulate`` measured per GPU on one GPU (the slowest GPU's inner optimizer step,
median of rounds): DMuon's whole-matrix layout (the greedy, --dmuon-balance cost), its split layout
(--dmuon-dp-layout split; its exchange to the NS homes modelled: rank_layouts.split_cell_work), the
one the run picks (--dmuon-dp-layout auto: planning/owner_planning.choose_scheme, as
planning/dp_schemes.py asks it), Megatron-LM's LayerWise Muon and Megatron's AdamW. Communication is
modelled (planning/simulate.py, ``--cluster`` links, two-level collectives) for each one's own buffers:
the param all-gather that publishes the step (bf16) and the grad reduce-scatter (fp32), which runs in
the backward. Step = compute + the all-gather (not overlapped); iteration = the forward and backward of
``--global-batch`` sequences at the device's model rate (planning/compute_model.py) + the step + what
of the reduce-scatter the backward (2/3 of the compute) cannot hide. Beside them, DMuon's step under
--dmuon-overlap-step on (``overlapped_step_ms``: each need group's NS pipelined with Megatron's
per-bucket all-gathers) and AdamW's step with the same per-bucket all-gathers.
"""
from __future__ import annotations

import json
from pathlib import Path

from megatron_dmuon.planning.cost_model import CostModel, cluster_spec, load_config
from megatron_dmuon.planning.models import stage_params
from rank_layouts import ADAMW, MEGATRON, job_settings, make_plans, parse_layout

__all__ = ["scale", "scale_table", "scale_plot"]


def _forward_backward_ms(model, par, cluster, global_batch: int, seq_length: int = 4096) -> float:
    from megatron_dmuon.planning.compute_model import iteration_flops, model_tflops

    if model.num_experts:
        return 0.0
    per_gpu = max(global_batch // par.dp_size, 1)
    return iteration_flops(model, par, seq_length=seq_length, micro_batches=per_gpu) / (
        model_tflops(cluster.device.name) * 1e9)


def _picked_scheme(model, par, size, cluster) -> str:
    """The layout a run picks at one instance (--dmuon-dp-layout auto), as dmuon plan reports it."""
    from megatron_dmuon.planning.dp_schemes import compare_dp_layouts

    report = compare_dp_layouts(model, par, CostModel(cluster.device), cluster, load_config()["optimizer"],
                                instances=[1], bucket_size=size, overlap_grad_reduce=size is not None, two_level=True)
    return next(c["scheme"] for c in report["candidates"] if c.get("run_choice"))


def scale(args, log):
    from megatron_dmuon.planning.simulate import collective_ms

    cluster = cluster_spec(args.cluster)
    cfg = job_settings(args.flags.split())
    rows = []
    for path in args.emulation:
        for spec, lay in json.loads(Path(path).read_text())["layouts"].items():
            model, par, size = parse_layout(spec)
            if par.tp > 1:
                continue
            plans = lay["plans"]
            buffers = {}  # per plan: {kind: (elements, DP group)} of the buffers it reduces and gathers
            wanted = [p for p in ("greedy", "split", "megatron_lpt") if p in plans or (p == "megatron_lpt" and MEGATRON in plans)]
            made = make_plans(model, par, size, cfg, wanted)
            for name, plan in made.items():
                buffers[name] = {k: (l.numel, l.world_size) for k, l in plan["layouts"].items()}
                if name == "split":
                    plans = dict(plans, split=_exchange_as_now(plans["split"], plan, par, spec, log))
            whole = {k: (sum(p.numel for p in ps), par.dp_size if k == "dense" else par.expert_dp_size)
                     for k, ps in stage_params(model, par).items() if ps}

            def comm(bufs, nbytes):
                return sum(collective_ms(cluster, d, 1, n * nbytes, two_level=True) for n, d in bufs.values())

            fwd_bwd = _forward_backward_ms(model, par, cluster, args.global_batch)
            row = {"layout": spec, "gpus": par.world, "cluster": args.cluster, "forward_backward_ms": fwd_bwd}
            for key, plan, compute_key, bufs in (("dmuon", "greedy", "slowest_ms", "greedy"),
                                                 ("dmuon_split", "split", "slowest_with_exchange_ms", "split"),
                                                 ("megatron", MEGATRON, "slowest_ms", "megatron_lpt"),
                                                 ("adamw", ADAMW, "slowest_ms", None)):
                if plan not in plans:
                    continue
                b = whole if bufs is None else buffers[bufs]
                row |= {f"{key}_ms": plans[plan][compute_key], f"{key}_publish_ms": comm(b, 2),
                        f"{key}_reduce_ms": comm(b, 4)}
                step = row[f"{key}_ms"] + row[f"{key}_publish_ms"]
                row[f"{key}_iteration_ms"] = fwd_bwd + step + max(0.0, row[f"{key}_reduce_ms"] - 2 / 3 * fwd_bwd)
                # (not where the split plan has teams: --dmuon-overlap-step refuses --dmuon-ns-teams' teams)
                teams = bufs in made and any(lay.teams for lay in made[bufs]["layouts"].values())
                if key in ("dmuon", "dmuon_split") and "ranks" in plans[plan] and not teams:
                    on = overlapped_step_ms(made[bufs], par, cluster, plans[plan]["ranks"], narrow=key == "dmuon_split")
                    row[f"{key}_on_ms"] = on
                    row[f"{key}_on_iteration_ms"] = fwd_bwd + on + max(0.0, row[f"{key}_reduce_ms"] - 2 / 3 * fwd_bwd)
            if "split" in made and ADAMW in plans:  # (the split layout's buffers are Megatron's own: AdamW's)
                row["adamw_on_ms"] = plans[ADAMW]["slowest_ms"] + sum(bucket_all_gathers_ms(made["split"], cluster))
            if "milp" in plans:
                row["dmuon_milp_ms"] = plans["milp"]["slowest_ms"]
            if "dmuon_ms" in row and "dmuon_split_ms" in row:
                row["picked"] = _picked_scheme(model, par, size, cluster)
            rows.append(row)
            log({"scale_row": spec})
    rows.sort(key=lambda r: (r["layout"].split("/")[0], r["gpus"], r["layout"]))
    return {"scale_rows": rows, "cluster": args.cluster, "global_batch": args.global_batch}


def overlapped_step_ms(plan, par, cluster, ranks, narrow: bool = True) -> float:
    """The step of a DMuon plan under --dmuon-overlap-step on (planning/simulate_overlap.
    pipelined_publish_ms: each need group's all-gather starts once every GPU has its NS, and the
    split layout's directions, back), from each GPU's measured compute (``ranks``: the emulation's,
    one per GPU) cut in two by the cost model: the element-wise passes (the step's momentum, apply and
    AdamW bytes at the HBM rate), which run before the NS stream starts, and the NS of each need group
    (the owner cost model's share of each group). The split layout's exchange (planning/split_layout.
    exchange_ways_ms, ``narrow``: directions back in 16 bits as on CUDA): every group's pieces to their
    homes in the step; each group's way back just before its all-gather, on the same communicator.
    The all-gathers are per bucket (bf16), modelled as the table's publish; no forward runs beside."""
    from megatron_dmuon.planning.cost_model import load_config
    from megatron_dmuon.planning.simulate_overlap import group_ns_ms, need_groups, pipelined_publish_ms
    from megatron_dmuon.planning.split_layout import exchange_ways_ms, narrow_directions

    if par.tp > 1:
        raise ValueError("the overlapped step is modelled at TP = 1 only (the run refuses it under TP)")
    opt = load_config()["optimizer"]
    groups, param_need = need_groups(plan)
    model_ns = group_ns_ms(plan, par, CostModel(cluster.device), param_need)
    hbm = cluster.device.hbm_gbytes_per_s * 1e6  # bytes per ms
    elementwise, ns = [], []
    for x in sorted(ranks, key=lambda x: x["gpu"]):
        el = ((x["muon_elements"] + x.get("tp_shard_elements", 0)) * opt["muon_bytes_per_param"]
              + x["adamw_elements"] * opt["adamw_bytes_per_param"]) / hbm
        work = model_ns[x["gpu"]]
        share = x["ms"] / (el + sum(work.values())) if el + sum(work.values()) > 0 else 0.0
        elementwise.append(share * el)
        ns.append({need: share * ms for need, ms in work.items()})
    if len(ns) != par.dp_size:
        raise ValueError(f"the emulation has {len(ns)} GPUs of a DP {par.dp_size} stage: one entry per GPU is needed")
    there, back = [0.0] * par.dp_size, {}
    spec = cluster_spec(cluster.name)
    for kind, layout in plan["layouts"].items():
        if layout.scheme != "split":
            continue
        mats = [p.name for p in plan["params"][kind] if p.is_matrix]
        links = (layout, spec.intra, spec.inter, spec.gpus_per_node // par.tp)
        wide = narrow_directions(set(mats) - set(layout.teams), par.tp) if narrow else ()
        there = [a + b for a, b in zip(there, exchange_ways_ms(*links, narrow=wide)[0])]  # every group at once
        for grp in groups:
            if grp["kind"] == kind:
                names = {n for n in mats if param_need[n] == grp["need"]}
                back[grp["need"]] = max(exchange_ways_ms(*links, narrow=wide, matrices=names)[1], default=0.0)
    ag = bucket_all_gathers_ms(plan, cluster)
    return pipelined_publish_ms(max(elementwise) + max(there), ns, back, ag)


def bucket_all_gathers_ms(plan, cluster) -> list:
    """Megatron's param all-gather of each need group (one per bucket, bf16, in need order), each
    its own collective (planning/simulate.collective_ms, two-level), as Megatron's DDP issues them."""
    from megatron_dmuon.planning.simulate import collective_ms
    from megatron_dmuon.planning.simulate_overlap import need_groups

    return [collective_ms(cluster, plan["layouts"][g["kind"]].world_size, 1, g["numel"] * 2, two_level=True)
            for g in need_groups(plan)[0]]


def _exchange_as_now(row, plan, par, spec, log):
    """The split row with its exchange modelled as the runtime moves it now (split_cell_work: a file
    emulated before a change of the exchange keeps its measured compute); the same homes as the
    emulation's, or the row as it was (logged)."""
    from rank_layouts import split_cell_work

    if "ranks" not in row:  # (a summary row: nothing per GPU to recombine)
        return row
    cells = split_cell_work(plan, par)
    if len(cells) != len(row["ranks"]) or any(sum(cells[x["gpu"]][0]) != x["tp_shard_elements"] for x in row["ranks"]):
        log({"layout": spec, "split_exchange": "as emulated: today's plan puts other pieces on the GPUs"})
        return row
    ranks = [dict(x, tp_exchange_ms=cells[x["gpu"]][1]) for x in row["ranks"]]
    return dict(row, ranks=ranks, slowest_with_exchange_ms=max(x["ms"] + x["tp_exchange_ms"] for x in ranks))


def _step(r, key):
    return r[key + "_ms"] + r[key + "_publish_ms"]


def scale_table(result):
    def cell(r, key):
        if key + "_ms" not in r:
            return "— | — | —"
        return f"{r[key + '_ms']:.1f} | {_step(r, key):.1f} | {r[key + '_iteration_ms']:.0f}"

    lines = [f"Compute measured per GPU on one GPU (the slowest GPU's inner optimizer step, median of rounds; the split "
             f"layout's exchange to its NS homes modelled), communication modelled ({result['cluster']} links, two-level "
             "collectives, planning/simulate.py): step = compute + the param all-gather of each one's buffers (whole-"
             "matrix buffers pad each shard to the matrices it holds; the split layout's are Megatron's own); iteration "
             f"= forward + backward of {result.get('global_batch', 1024)} sequences of 4096 tokens at the device's model "
             "rate + step + the reduce-scatter the backward cannot hide. DMuon's pick is --dmuon-dp-layout auto's.", "",
             "The --dmuon-overlap-step on column: each need group's NS pipelined with Megatron's per-bucket "
             "all-gathers (bench/rank_scale.overlapped_step_ms), against AdamW's step with the same per-bucket "
             "all-gathers; no forward beside either.", "",
             "| layout | GPUs | DMuon pick | DMuon step ms (x AdamW) | DMuon iteration ms (x AdamW) | whole: compute / step / "
             "iteration ms | split: compute / step / iteration ms | Megatron LayerWise: compute / step / iteration ms | "
             "AdamW: compute / step / iteration ms | --dmuon-overlap-step on: whole / split / AdamW per-bucket step ms "
             "(x AdamW) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["scale_rows"]:
        pick = {"whole": "dmuon", "split": "dmuon_split"}.get(r.get("picked"), "dmuon" if "dmuon_ms" in r else "dmuon_split")
        if pick + "_ms" in r and "adamw_ms" in r:
            step = f"{_step(r, pick):.1f} ({_step(r, pick) / _step(r, 'adamw'):.2f})"
            it = f"{r[pick + '_iteration_ms']:.0f} ({r[pick + '_iteration_ms'] / r['adamw_iteration_ms']:.3f})"
        else:
            step = it = "—"
        lines.append(f"| {r['layout']} | {r['gpus']} | {r.get('picked', '—')} | {step} | {it} | {cell(r, 'dmuon')} | "
                     f"{cell(r, 'dmuon_split')} | {cell(r, 'megatron')} | {cell(r, 'adamw')} | {_on_cell(r)} |")
    return "\n".join(lines)


def _on_cell(r) -> str:
    base = r.get("adamw_on_ms")

    def one(key):
        if key not in r:
            return "—"
        return f"{r[key]:.1f}" + (f" ({r[key] / base:.2f})" if base else "")

    return f"{one('dmuon_on_ms')} / {one('dmuon_split_on_ms')} / " + (f"{base:.1f}" if base else "—")


def scale_plot(result, path: str) -> None:
    """Step and iteration against the GPU count, per model: DMuon's pick, its whole and split layouts,
    Megatron's LayerWise Muon and AdamW (the scale table's rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["layout"].split("/")[0] for r in result["scale_rows"]})
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False)
    series = (("dmuon", "DMuon whole", "C0", "--"), ("dmuon_split", "DMuon split", "C2", "--"),
              ("megatron", "Megatron LayerWise", "C1", "-"), ("adamw", "AdamW", "k", "-"))
    for col, model in enumerate(models):
        rows = [r for r in result["scale_rows"] if r["layout"].startswith(model + "/")]
        for row, (what, label) in enumerate((("step", "optimizer step ms"), ("iteration", "iteration ms"))):
            ax = axes[row][col]
            for key, name, color, style in series:
                pts = [(r["gpus"], _step(r, key) if what == "step" else r[key + "_iteration_ms"])
                       for r in rows if key + "_ms" in r]
                if pts:
                    ax.plot(*zip(*pts), style, color=color, marker="o", ms=3, label=name)
            picks = [(r["gpus"], _step(r, "dmuon" if r.get("picked") == "whole" else "dmuon_split") if what == "step"
                      else r[("dmuon" if r.get("picked") == "whole" else "dmuon_split") + "_iteration_ms"])
                     for r in rows if "picked" in r]
            if picks:
                ax.plot(*zip(*picks), "-", color="C3", lw=2.5, alpha=0.6, label="DMuon (the run's pick)")
            if what == "step":  # --dmuon-overlap-step on: each group's NS beside the per-bucket all-gathers
                for key, name, color in (("dmuon_on_ms", "DMuon whole, overlap on", "C0"),
                                         ("dmuon_split_on_ms", "DMuon split, overlap on", "C2"),
                                         ("adamw_on_ms", "AdamW, per-bucket all-gathers", "k")):
                    pts = [(r["gpus"], r[key]) for r in rows if key in r]
                    if pts:
                        ax.plot(*zip(*pts), ":", color=color, marker="x", ms=4, label=name)
            ax.set(xscale="log", yscale="log", title=f"{model}: {label}", xlabel="GPUs (DP)", ylabel="ms")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
