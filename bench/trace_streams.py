"""What ran where in a torch.profiler Chrome trace (the main job's --profile-out, e.g. with
--profile-iterations): per CUDA stream its kernels' busy time and span, the step's and the overlapped
NS's ranges on the host and on the GPU, and the host's long stream syncs (what the host waited for).

    python bench/trace_streams.py overlap_profile.trace.json.gz [--min-sync-ms 1]

Times are ms from the trace's first event.
"""
from __future__ import annotations

import gzip
import json
from collections import defaultdict

from cli_inputs import OneLineParser, without_fix  # (first: it puts the repository on the path)

from megatron_dmuon.files import check_regular_file

RANGES = ("Optimizer.step", "dmuon.ns_launch", "dmuon.finish_group")


def load(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summary(events: list, min_sync_ms: float = 1.0) -> str:
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e]
    t0 = min(e["ts"] for e in timed)
    ms = lambda us: round((us - t0) / 1e3, 1)  # noqa: E731
    lines = ["| stream | kernels | busy ms | first ms | last ms |", "|---|---:|---:|---:|---:|"]
    streams = defaultdict(list)
    for e in timed:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            streams[e["args"].get("stream")].append(e)
    for s, ks in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        lines.append(f"| {s} | {len(ks)} | {sum(e['dur'] for e in ks) / 1e3:.1f} | {ms(min(e['ts'] for e in ks))} | "
                     f"{ms(max(e['ts'] + e['dur'] for e in ks))} |")
    lines += ["", "| where | range | start ms | duration ms |", "|---|---|---:|---:|"]
    for cat, where in (("user_annotation", "host"), ("gpu_user_annotation", "GPU")):
        for e in sorted((e for e in timed if e.get("cat") == cat and e["name"].startswith(RANGES)), key=lambda e: e["ts"]):
            lines.append(f"| {where} | {e['name'].split('#')[0]} | {ms(e['ts'])} | {e['dur'] / 1e3:.2f} |")
    syncs = [e for e in timed if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]
             and e["dur"] >= min_sync_ms * 1e3]
    lines += ["", "| host sync | start ms | waited ms |", "|---|---:|---:|"]
    lines += [f"| {e['name']} | {ms(e['ts'])} | {e['dur'] / 1e3:.1f} |" for e in sorted(syncs, key=lambda e: e["ts"])]
    return "\n".join(lines)


def checked_events(p, path: str) -> list:
    """The trace's timed events; a usage error naming the file when it is no Chrome trace with any."""
    kind = "a Chrome trace (JSON, or .json.gz) of the main job's --profile-out"
    try:
        check_regular_file(path, "trace", limit=1 << 34)
        events = load(path)
    except json.JSONDecodeError as e:
        p.error(f"trace {path} is not JSON ({e}); give {kind}")
    except ValueError as e:  # (not a regular file, too large)
        p.error(f"{without_fix(str(e))}; give {kind}")
    except (OSError, EOFError, UnicodeDecodeError) as e:  # (a cut or garbage .gz)
        p.error(f"trace {path} does not read ({type(e).__name__}: {e}); give {kind}")
    except (KeyError, TypeError):
        p.error(f"trace {path} holds no 'traceEvents'; give {kind}")
    if not isinstance(events, list) or not any(isinstance(e, dict) and e.get("ph") == "X" and "ts" in e
                                               for e in events):
        p.error(f"trace {path} holds no timed events; give {kind}")
    return events


def main(argv=None) -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--min-sync-ms", type=float, default=1.0, help="list host stream/device syncs at least this long")
    args = p.parse_args(argv)
    print(summary(checked_events(p, args.trace), args.min_sync_ms))


if __name__ == "__main__":
    main()
