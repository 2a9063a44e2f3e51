"""The files `dmuon plan` reads, each read as data and checked for what its flag takes: a plan a run
recorded (``--show``), a measured NS profile (``--profile``), a rank cost model (``--rank-model``).
Each raises ValueError saying what the file holds instead (the CLI makes it a usage error)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..files import check_regular_file, read_bounded_text
from .cost_model import CostTable, load_bench_kernels_profile

__all__ = ["show_plan", "BadProfile", "load_profile", "RANK_MODEL_KINDS", "load_rank_model"]


def show_plan(path: str, as_json: bool = False) -> str:
    """The plan a run recorded: one line per Muon matrix and a summary (or the plan's JSON).
    Raises ValueError naming what the file is instead (``main`` makes it an argparse error)."""
    from .plan import DMuonPlan

    what = "a plan JSON (DMuonPlan.to_json) or the main job's --timing-json of a --optimizer dmuon run"
    try:
        if os.path.exists(path) and not os.path.isdir(path):  # (a missing file or a folder: the OSError below)
            check_regular_file(path, "the plan")  # a device or FIFO is not read
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot be read ({getattr(exc, 'strerror', None) or exc}): give {what}") from None
    if not text.strip():
        raise ValueError(f"is empty: give {what}")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"is not JSON ({exc}): give {what}") from None
    if isinstance(data, dict) and "dmuon_plan" in data:  # the main job's --timing-json
        data = data["dmuon_plan"]
    if not isinstance(data, dict) or data.get("records") is None:
        raise ValueError(f"holds no DMuon plan (a JSON {type(data).__name__.replace('dict', 'object')} without "
                         f"'records'): give {what}")
    try:
        plan = DMuonPlan.from_json(json.dumps(data))
        return plan.to_json() if as_json else plan.describe()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ValueError(f"holds a DMuon plan that does not read ({type(exc).__name__}: {exc}): give {what}, "
                         "written by this version") from None


class BadProfile(ValueError):
    """A --profile file that reads but holds no usable measurement (the message says which)."""


def load_profile(path: str, steps: int = 5) -> CostTable:
    """--profile: a CostTable JSON, a one-entry profile cache, or the kernel benchmark's JSON. Raises
    ValueError where it holds none of these, no points, or a point that is not a time."""
    import math

    data = json.loads(read_bounded_text(path, "the profile"))
    if not isinstance(data, dict):
        raise BadProfile(f"not a CostTable, a one-entry profile cache or a kernel benchmark JSON (it holds a JSON "
                         f"{type(data).__name__})")
    if "autotune" in data or "shapes" in data:
        table = load_bench_kernels_profile(path, steps)
    elif "points" in data:
        table = CostTable.from_json(data)
    else:
        entries = data.get("entries", {})
        if not isinstance(entries, dict) or len(entries) != 1:  # a profile cache file holding one device's profile
            raise ValueError(f"{path}: not a CostTable, a one-entry profile cache or a kernel benchmark JSON")
        table = CostTable.from_json(next(iter(entries.values())))
    if not any(table.points.values()):
        raise BadProfile("it holds no measured points: profile the shapes, or leave --profile out (analytic costs)")
    for shape, pts in table.points.items():
        for batch, ms in pts:
            if batch < 1 or not (math.isfinite(ms) and ms >= 0):
                raise BadProfile(f"shape {shape[0]}x{shape[1]} has the point (batch {batch}, {ms} ms): a batch "
                                 "must be >= 1 and a time a finite number of ms >= 0")
    return table


RANK_MODEL_KINDS = ("'analytic', a rank cost model JSON (RankCostModel.to_json), bench/rank_balance.py calibrate's "
                    "JSON or a start-up profile cache holding one rank profile")


def load_rank_model(spec: str, config: dict, device: str, steps: int = 5, ns_method: str = "auto"):
    """--rank-model: 'analytic' or a JSON file (a RankCostModel, a start-up profile cache with one
    rank profile entry, or bench/rank_balance.py calibrate's result). Raises ValueError saying what
    the file holds instead, or which measured point is not a time (no points, a negative, NaN or
    infinite ms)."""
    import math

    from .cost_model import device_spec
    from .rank_cost import RankCostModel

    spec_device = device_spec(device, config)
    if spec == "analytic":
        return RankCostModel.analytic(spec_device, steps, ns_method, config)
    data = json.loads(read_bounded_text(spec, "the rank model"))
    if not isinstance(data, dict):
        raise ValueError(f"holds a JSON {type(data).__name__}; give {RANK_MODEL_KINDS}")
    if "stacks" not in data and "jobs" not in data:
        ranks = [e for e in (data.get("entries") or {}).values() if isinstance(e, dict) and "jobs" in e] \
            if isinstance(data.get("entries"), dict) else []
        if len(ranks) != 1:
            raise ValueError(f"is not a rank cost model ({len(ranks)} rank profiles, no 'stacks' or 'jobs'); "
                             f"give {RANK_MODEL_KINDS}")
        data = ranks[0]

    def time_ms(value, where):
        try:
            ms = float(value)
        except (TypeError, ValueError):
            ms = float("nan")
        if not (math.isfinite(ms) and ms >= 0):
            raise ValueError(f"{where} is {value!r}: a measured time must be a finite number of ms >= 0 "
                             "(measure again with bench/rank_balance.py calibrate, or use --rank-model analytic)")

    if "stacks" in data:
        if not isinstance(data["stacks"], dict) or not isinstance(data.get("adamw", []), list):
            raise ValueError("'stacks' must map MxN to [[k, ms], ...] and 'adamw' be a list of [elements, fragments, ms]")
        for shape, pts in data["stacks"].items():
            for point in pts:
                time_ms(point[1] if isinstance(point, (list, tuple)) and len(point) == 2 else None,
                        f"the time of stack {shape} point {point!r}")
        for point in data.get("adamw", []):
            time_ms(point[2] if isinstance(point, (list, tuple)) and len(point) == 3 else None,
                    f"the time of AdamW point {point!r}")
        for key in ("shared_ms", "muon_ms_per_element"):
            if key in data:
                time_ms(data[key], f"'{key}'")
        if not data["stacks"] and not data.get("adamw") and not data.get("muon_ms_per_element"):
            raise ValueError("holds no measured points (empty 'stacks' and 'adamw') and no analytic rate: measure "
                             "them (bench/rank_balance.py calibrate) or use --rank-model analytic")
        return RankCostModel.from_json(data, config)
    jobs = data["jobs"]
    if not isinstance(jobs, dict) or not jobs:
        raise ValueError("holds no measured points ('jobs' is empty): measure them (bench/rank_balance.py calibrate) "
                         "or use --rank-model analytic")
    for name, job in jobs.items():
        time_ms(job.get("ms") if isinstance(job, dict) else None, f"the 'ms' of job {name!r}")
    return RankCostModel.from_calibration(data, spec_device)
