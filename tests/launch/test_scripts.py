"""Launch files: shell syntax, the Slurm template rendered for 2 nodes x 8 GPUs and dry-run with stub
srun/scontrol/torchrun, the one-node torchrun launcher, patches/apply.sh on synthetic trees, and
(with a Megatron-LM checkout around) the recipes through Megatron-LM's own parser."""
from __future__ import annotations

import glob
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PATCH = os.path.join(ROOT, "patches", "pretrain_gpt.patch")
APPLY = os.path.join(ROOT, "patches", "apply.sh")
sys.path.insert(0, os.path.join(ROOT, "launch", "slurm"))
import render  # noqa: E402

sys.path.pop(0)

SHELL_FILES = sorted(glob.glob(os.path.join(ROOT, "launch", "**", "*.sh"), recursive=True)
                     + glob.glob(os.path.join(ROOT, "launch", "slurm", "*.sbatch")) + [APPLY])


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_shell_files_parse(path):
    proc = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------- synthetic trees
def _patch_images():
    """(pre-image, post-image) lines of the patch's hunk: the file it expects and the file it makes."""
    lines = open(PATCH).read().splitlines()
    body = lines[next(i for i, l in enumerate(lines) if l.startswith("@@")) + 1:]
    before = [l[1:] for l in body if l[:1] in (" ", "-")]
    after = [l[1:] for l in body if l[:1] in (" ", "+")]
    return before, after


HEAD = ["# synthetic pretrain_gpt.py", "import os", "", 'if __name__ == "__main__":']
SURFACE = {
    "megatron/training/arguments.py": "def add_megatron_arguments(parser):\n    return parser\n\n"
                                      "def parse_args():\n    parser = add_megatron_arguments(parser)\n\n"
                                      "def validate_args(args, defaults={}):\n    return args\n",
    "megatron/training/training.py": "from megatron.core.distributed import DistributedDataParallel as DDP\n"
                                     "from megatron.core.optimizer.qk_clip import clip_qk\n"
                                     "optimizer = get_megatron_optimizer(config, model)\n",
    "megatron/training/models/dist_utils.py": "        DP = DistributedDataParallel\n",
    "megatron/core/package_info.py": "MAJOR = 0\nMINOR = 19\nPATCH = 1\n",
}


def make_tree(root, pretrain_lines=None, surface=None):
    before, _ = _patch_images()
    files = dict(SURFACE, **(surface or {}))
    files["pretrain_gpt.py"] = "\n".join(HEAD + (before if pretrain_lines is None else pretrain_lines)) + "\n"
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)


def apply(tree):
    return subprocess.run(["bash", APPLY, tree], capture_output=True, text=True, timeout=60)


def read(tree):
    return open(os.path.join(tree, "pretrain_gpt.py")).read()


def test_apply_patches_then_is_a_no_op(tmp_path):
    tree = make_tree(tmp_path)
    first = apply(tree)
    assert first.returncode == 0, first.stderr
    assert read(tree) == "\n".join(HEAD + _patch_images()[1]) + "\n"
    assert "megatron_dmuon.megatron.install()" in read(tree)
    patched = read(tree)
    again = apply(tree)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert read(tree) == patched
    assert not glob.glob(os.path.join(tree, "*.orig")) + glob.glob(os.path.join(tree, "*.rej"))


@pytest.mark.parametrize("case,expect", [
    ("context", "does not take pretrain_gpt.patch"),
    ("surface", "get_megatron_optimizer("),
    ("hand_edited", "restore the file"),
    ("not_megatron", "is not a Megatron-LM checkout"),
])
def test_apply_refuses_a_wrong_tree_and_changes_nothing(tmp_path, case, expect):
    before, _ = _patch_images()
    if case == "context":  # another Megatron-LM version: the lines around the call moved
        tree = make_tree(tmp_path, [l.replace("pretrain, store", "pretrain, store_") for l in before])
    elif case == "surface":  # pretrain_gpt.py fits, but megatron.training lacks what install() replaces
        tree = make_tree(tmp_path, surface={"megatron/training/training.py": "DistributedDataParallel as DDP\n"})
    elif case == "hand_edited":
        tree = make_tree(tmp_path, before + ["import megatron_dmuon.megatron; megatron_dmuon.megatron.install()"])
    else:
        tree = str(tmp_path)
        (tmp_path / "pretrain_gpt.py").write_text("print('hello')\n")
    original = read(tree)
    proc = apply(tree)
    assert proc.returncode == 1 and expect in proc.stderr, proc.stderr
    assert read(tree) == original


# ----------------------------------------------------------------------------- Slurm, rendered
STUBS = {
    # first node of the allocation = rendezvous host
    "scontrol": 'echo "node-a"; echo "node-b"',
    # one task per node: run the command line as every node would, printing it
    "srun": 'n=1; for a in "$@"; do case "$a" in --nodes=*) n="${a#--nodes=}";; esac; done\n'
            'while [ "$1" != torchrun ]; do shift; done\n'
            'for i in $(seq "$n"); do printf "node%s NCCL_NVLS_ENABLE=%s PYTHONPATH=%s ARGV" "$i" '
            '"$NCCL_NVLS_ENABLE" "$PYTHONPATH"; printf " %q" "$@"; echo; done',
    "torchrun": 'printf "local NCCL_NVLS_ENABLE=%s PYTHONPATH=%s ARGV" "$NCCL_NVLS_ENABLE" "$PYTHONPATH"; '
                'printf " %q" torchrun "$@"; echo',
    "nvidia-smi": 'echo "GPU 0: H200"; echo "GPU 1: H200"',
}


def _stub_path(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body + "\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}:{os.environ['PATH']}"


def _argv_lines(stdout):
    """{line label: argv list} for the lines the stubs print."""
    out = {}
    for line in stdout.splitlines():
        if " ARGV " in line:
            label, argv = line.split(" ARGV ", 1)
            out[label] = shlex.split(argv)
    return out


def test_slurm_template_renders_two_nodes_of_eight_gpus(tmp_path):
    tree = make_tree(tmp_path / "Megatron-LM")
    text = render.render(2, 8, "qwen2.5_7b", tree, extra_args=["--save", "/ckpt dir"], partition="gpu")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "NODES=2", "GPUS_PER_NODE=8", "EXTRA_ARGS=(--save '/ckpt dir')"):
        assert line in text.splitlines(), line
    assert not re.search(r"@[A-Z_]+@", text)  # every token filled
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = dict(os.environ, PATH=_stub_path(tmp_path), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-[a-b]")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = _argv_lines(proc.stdout)
    assert set(lines) == {f"node{i} NCCL_NVLS_ENABLE=0 PYTHONPATH={ROOT}:{os.path.abspath(tree)}" for i in (1, 2)}
    argv = next(iter(lines.values()))
    assert argv[:6] == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=node-a:29500", "--rdzv-id=4242"]
    # the checkout's own pretrain_gpt.py, unmodified, through the launcher that installs the hook
    assert argv[6:9] == ["-m", "megatron_dmuon.megatron.run", os.path.join(os.path.abspath(tree), "pretrain_gpt.py")]
    megatron = argv[9:]
    assert " ".join(megatron).count("--optimizer dmuon --use-distributed-optimizer") == 1
    assert megatron[-4:] == ["--dmuon-ranks-per-node", "8", "--save", "/ckpt dir"]
    assert "--num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944" in " ".join(megatron)
    assert "megatron_dmuon.megatron.install()" not in read(tree)  # the checkout is left as it was
    _check_dmuon_accepts(megatron, world_size=16)


def _check_dmuon_accepts(megatron_argv, world_size):
    """The launch's Megatron-LM flags pass DMuon's parse-time checks (on the CI stand-in parser)."""
    from tests.megatron.test_megatron_lm import megatron_lm_parser

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        args, _ = megatron_lm_parser().parse_known_args(megatron_argv)
    finally:
        os.environ.pop("WORLD_SIZE") if saved is None else os.environ.__setitem__("WORLD_SIZE", saved)
    assert args.optimizer == "dmuon" and args.use_distributed_optimizer
    assert (args.muon_momentum, args.muon_nesterov, args.muon_extra_scale_factor) == (0.95, True, 0.2)


@pytest.mark.parametrize("flags,message", [
    (["--nodes", "0"], "--nodes must be a positive integer (got 0)"),
    (["--cpus-per-task", "-4"], "--cpus-per-task must be a positive integer (got -4)"),
    (["--time", "four hours"], "--time 'four hours' is not a Slurm time: MINUTES, MINUTES:SECONDS"),
    (["--time", "4:75:00"], "--time '4:75:00' is not a Slurm time"),
    (["--job-name", "my job"], "--job-name 'my job' cannot go on an #SBATCH line"),
    (["--partition", "gpu\necho INJECTED"], "--partition 'gpu\\necho INJECTED' cannot go on an #SBATCH line"),
    (["--account", "a;b"], "--account 'a;b' cannot go on an #SBATCH line"),
    (["--output", "log $HOME.out"], "--output 'log $HOME.out' cannot go on an #SBATCH line"),
    (["--megatron-lm", "MISSING"], "--megatron-lm MISSING does not exist: give a Megatron-LM checkout"),
    (["--megatron-lm", "EMPTY"], "--megatron-lm EMPTY has no pretrain_gpt.py and no megatron/training"),
    (["-o", "TEMPLATE"], "-o TEMPLATE is one of launch/'s own files"),
    (["-o", "FOREIGN"], "-o FOREIGN exists and was not written by render.py"),
    (["-o", "IN_TREE"], "-o IN_TREE is inside the Megatron-LM checkout"),
], ids=["nodes_0", "cpus_negative", "time_words", "time_minutes_75", "job_name_space", "partition_newline",
        "account_semicolon", "output_space", "megatron_lm_missing", "megatron_lm_empty", "out_template", "out_foreign",
        "out_in_tree"])
def test_render_refuses_bad_values_by_flag_and_writes_nothing(tmp_path, capsys, flags, message):
    """A job name with a space, --time "four hours", negative CPUs, a partition holding a
    newline (its next line went into the script body) and a missing checkout were rendered before."""
    tree = make_tree(tmp_path / "Megatron-LM")
    (tmp_path / "empty").mkdir()
    foreign = tmp_path / "notes.sbatch"
    foreign.write_text("#!/bin/bash\n# my own job\n")
    names = {"MISSING": str(tmp_path / "nope"), "EMPTY": str(tmp_path / "empty"), "TEMPLATE": render.TEMPLATE,
             "FOREIGN": str(foreign), "IN_TREE": os.path.join(tree, "job.sbatch")}
    flags = [names.get(f, f) for f in flags]
    base = {"--nodes": "2", "--gpus-per-node": "8", "--recipe": "gpt_small", "--megatron-lm": tree}
    for flag, value in zip(flags[::2], flags[1::2]):
        base[flag] = value
    before = {p: open(p, "rb").read() for p in (render.TEMPLATE, str(foreign), os.path.join(tree, "pretrain_gpt.py"))}
    with pytest.raises(SystemExit) as exit_info:
        render.main([a for kv in base.items() for a in kv])
    err = capsys.readouterr().err
    for name, path in names.items():
        message = message.replace(name, path)
    assert exit_info.value.code == 2 and message in err, err
    assert {p: open(p, "rb").read() for p in before} == before and not os.path.exists(os.path.join(tree, "job.sbatch"))
    with pytest.raises(ValueError, match="unknown"):
        render.render(1, 8, "llama", tree)


def test_render_replaces_only_what_it_rendered(tmp_path):
    tree = make_tree(tmp_path / "Megatron-LM")
    out = tmp_path / "job.sbatch"
    argv = ["--nodes", "1", "--gpus-per-node", "8", "--recipe", "gpt_small", "--megatron-lm", tree, "-o", str(out)]
    for time in ("90", "1-12", "2-00:30:00", "UNLIMITED"):
        assert render.main([*argv, "--time", time, "--job-name", "dmuon.run-1", "--partition", "gpu,gpu2"]) == 0
        assert f"#SBATCH --time={time}" in out.read_text().splitlines() and render.MARK in out.read_text()


def test_one_node_torchrun_launcher(tmp_path):
    tree = make_tree(tmp_path / "Megatron-LM")
    env = dict(os.environ, PATH=_stub_path(tmp_path), MEGATRON_LM=tree, NO_TE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "torchrun_megatron_lm.sh"), "gpt_small",
                           "--train-iters", "10"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (label, argv), = _argv_lines(proc.stdout).items()
    assert label == f"local NCCL_NVLS_ENABLE=0 PYTHONPATH={ROOT}:{tree}"
    assert argv[:7] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2",
                        "-m", "megatron_dmuon.megatron.run", os.path.join(tree, "pretrain_gpt.py")]
    joined = " ".join(argv)
    assert "--transformer-impl local" in joined and "--mock-data --tokenizer-type NullTokenizer --vocab-size 32000" in joined
    assert argv[-2:] == ["--train-iters", "10"]
    assert "megatron_dmuon.megatron.install()" not in read(tree)
    _check_dmuon_accepts(argv[7:], world_size=2)
    # DMUON_PATCH=1: the checkout patched (idempotently), its script run directly
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "torchrun_megatron_lm.sh"), "gpt_small"],
                          capture_output=True, text=True, env=dict(env, DMUON_PATCH="1"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    (_, argv), = _argv_lines(proc.stdout).items()
    assert argv[4] == os.path.join(tree, "pretrain_gpt.py") and "megatron_dmuon.megatron.install()" in read(tree)


@pytest.mark.parametrize("env_vars,no_gpus,message", [
    ({}, "no_nvidia_smi", "launch: nvidia-smi not found, so the GPUs cannot be counted: set GPUS_PER_NODE"),
    ({}, "lists_none", "launch: nvidia-smi -L lists no GPU here: run on a GPU node, or set GPUS_PER_NODE"),
    ({"GPUS_PER_NODE": "0"}, None, "launch: GPUS_PER_NODE=0 must be a positive integer"),
    ({"GPUS_PER_NODE": "-2"}, None, "launch: GPUS_PER_NODE=-2 must be a positive integer"),
    ({"GPUS_PER_NODE": "two"}, None, "launch: GPUS_PER_NODE=two must be a positive integer"),
    ({"GPUS_PER_NODE": "4"}, None, "launch: GPUS_PER_NODE=4 is more than the 2 GPUs nvidia-smi lists here"),
    ({"GPUS_PER_NODE": "1"}, "no_nvidia_smi", None),  # no nvidia-smi is fine where GPUS_PER_NODE says
    ({"NO_TE": "yes"}, None, "launch: NO_TE=yes must be one of: 0 1"),
    ({"DMUON_PATCH": "true"}, None, "launch: DMUON_PATCH=true must be one of: 0 1"),
    ({"GRAD_ACCUM_FUSION": "on"}, None, "launch: GRAD_ACCUM_FUSION=on must be one of: auto 0 1"),
    ({"CUDA_DEVICE_MAX_CONNECTIONS": "0"}, None, "launch: CUDA_DEVICE_MAX_CONNECTIONS=0 must be a positive integer"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "9"}, None, "must be one of: 0 1 2 3"),
    ({"DATA_PATH": "/nonexistent/corpus"}, None, "launch: DATA_PATH=/nonexistent/corpus: no /nonexistent/corpus.bin"),
], ids=["no_nvidia_smi", "no_gpu_listed", "gpus_0", "gpus_negative", "gpus_word", "gpus_more_than_listed",
        "gpus_without_nvidia_smi", "no_te", "dmuon_patch", "grad_accum_fusion", "cuda_connections", "nccl_async",
        "data_path"])
def test_one_node_launcher_checks_its_environment_first(tmp_path, env_vars, no_gpus, message):
    """Without nvidia-smi, or with GPUS_PER_NODE=0, torchrun started with no ranks (or
    "command not found" on the way); the other variables were taken as they came."""
    import shutil

    tree = make_tree(tmp_path / "Megatron-LM")
    path = _stub_path(tmp_path)
    if no_gpus:
        os.remove(tmp_path / "bin" / "nvidia-smi")
        if no_gpus == "lists_none":
            (tmp_path / "bin" / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'No devices were found'\n")
            (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
        else:  # only the stubs and the tools the script uses: no nvidia-smi, wherever the machine has one
            tools = tmp_path / "tools"
            tools.mkdir()
            for tool in ("bash", "dirname", "grep", "ls", "sed", "tr", "cat", "env", "python3"):
                if shutil.which(tool):
                    (tools / tool).symlink_to(shutil.which(tool))
            path = f"{tmp_path / 'bin'}:{tools}"
    env = dict(os.environ, PATH=path, MEGATRON_LM=tree, NO_TE="1")
    env.update(env_vars)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([shutil.which("bash"), os.path.join(ROOT, "launch", "torchrun_megatron_lm.sh"), "gpt_small"],
                          capture_output=True, text=True, env=env, timeout=60)
    if message is None:
        assert proc.returncode == 0 and "--nproc-per-node=1" in proc.stdout, proc.stderr
        return
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert " ARGV " not in proc.stdout and "megatron_dmuon.megatron.install()" not in read(tree)  # nothing ran


def test_slurm_job_checks_master_port(tmp_path):
    tree = make_tree(tmp_path / "Megatron-LM")
    script = tmp_path / "job.sbatch"
    script.write_text(render.render(2, 8, "gpt_small", tree))
    env = dict(os.environ, PATH=_stub_path(tmp_path), SLURM_JOB_ID="1", SLURM_JOB_NODELIST="node-[a-b]", NO_TE="1",
               MASTER_PORT="70000")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "launch: MASTER_PORT=70000 must be a TCP port, 1..65535" in proc.stderr, proc.stderr
    assert " ARGV " not in proc.stdout


def test_launcher_needs_a_checkout_and_a_known_recipe(tmp_path):
    launcher = os.path.join(ROOT, "launch", "torchrun_megatron_lm.sh")
    env = dict(os.environ, PATH=_stub_path(tmp_path))
    env.pop("MEGATRON_LM", None)
    proc = subprocess.run(["bash", launcher, "gpt_small"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "set MEGATRON_LM" in proc.stderr
    env["MEGATRON_LM"] = make_tree(tmp_path / "Megatron-LM")
    proc = subprocess.run(["bash", launcher, "llama"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "unknown RECIPE 'llama'" in proc.stderr


# ------------------------------------------------------------------- with a Megatron-LM checkout
def _checkout():
    path = os.environ.get("DMUON_MEGATRON_LM") or os.path.join(ROOT, ".mlm")
    return path if os.path.isfile(os.path.join(path, "megatron", "training", "arguments.py")) else None


@pytest.mark.skipif(_checkout() is None, reason="no Megatron-LM checkout ($DMUON_MEGATRON_LM or .mlm/)")
@pytest.mark.parametrize("recipe,world", [("gpt_small", 8), ("qwen2.5_7b", 16)])
def test_recipes_pass_megatron_lms_own_parser(recipe, world, tmp_path):
    """Every launch flag (shared, recipe, data, optimizer) exists in Megatron-LM core_v0.19.0, and
    the launch validates there with the hook installed."""
    tree = make_tree(tmp_path / "Megatron-LM")  # the launch files patch it; the real checkout parses
    printed = subprocess.run(
        ["bash", "-c", f'source {ROOT}/launch/megatron_lm_common.sh && printf "%s\\n" "${{MEGATRON_ARGS[@]}}"'],
        capture_output=True, text=True, check=True, env=dict(os.environ, RECIPE=recipe, MEGATRON_LM=tree))
    argv = printed.stdout.split("\n")[:-1] + ["--dmuon-ranks-per-node", "8"]
    script = ("import sys, typing\ntyping.override = getattr(typing, 'override', lambda f: f)\n"
              "import megatron_dmuon.megatron as dm; dm.install()\n"
              "from megatron.training.arguments import parse_and_validate_args\n"
              "args = parse_and_validate_args(args_defaults={'tokenizer_type': 'GPT2BPETokenizer'})\n"
              "print('OK', args.optimizer, args.num_layers, args.data_parallel_size, args.padded_vocab_size)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_checkout(), ROOT]), WORLD_SIZE=str(world), RANK="0",
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                          cwd=_checkout(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ok = proc.stdout.split("OK ")[-1].split()
    assert ok[0] == "dmuon" and int(ok[2]) == world
    if recipe == "qwen2.5_7b":
        assert ok[1:] == ["28", "16", "152064"]


@pytest.mark.skipif(_checkout() is None, reason="no Megatron-LM checkout ($DMUON_MEGATRON_LM or .mlm/)")
def test_patched_pretrain_gpt_main_parses_dmuon(tmp_path):
    """The real __main__ block: the in-process-restart wrapper parses the arguments before
    parse_and_validate_args, so install() must run before it (found on the H200: the first patch
    placed it after, and --optimizer dmuon was an invalid choice). On CPU the run gets past
    argument parsing and stops at Megatron's CUDA assertion."""
    import shutil

    tree = tmp_path / "Megatron-LM"
    shutil.copytree(_checkout(), tree, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    subprocess.run(["git", "-C", str(tree), "init", "-q"], check=True)
    pristine = subprocess.run(["bash", APPLY, str(tree)], capture_output=True, text=True)
    assert pristine.returncode == 0, pristine.stderr
    script = ("import sys, typing, runpy\ntyping.override = getattr(typing, 'override', lambda f: f)\n"
              "runpy.run_path('pretrain_gpt.py', run_name='__main__')\n")
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "256", "--optimizer", "dmuon", "--use-distributed-optimizer", "--transformer-impl", "local"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), ROOT]), WORLD_SIZE="1", RANK="0",
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                          cwd=tree, timeout=300)
    assert "invalid choice" not in proc.stderr, proc.stderr[-2000:]
    assert "optimizer ....................................... dmuon" in proc.stdout or "Megatron requires CUDA" in proc.stderr


@pytest.mark.parametrize("fusion,expected", [("auto", True), ("1", False)])
def test_te_launch_turns_wgrad_fusion_off_only_without_apex(tmp_path, fusion, expected):
    """With TE layers (no NO_TE) Megatron-LM's --gradient-accumulation-fusion needs Apex's extension for
    the output layer: the launcher keeps the default where it imports, else passes
    --no-gradient-accumulation-fusion and says why (GRAD_ACCUM_FUSION=1 keeps the default regardless)."""
    tree = make_tree(tmp_path / "Megatron-LM")
    env = dict(os.environ, RECIPE="gpt_small", MEGATRON_LM=tree, GRAD_ACCUM_FUSION=fusion)
    env.pop("NO_TE", None)
    printed = subprocess.run(
        ["bash", "-c", f'source {ROOT}/launch/megatron_lm_common.sh && printf "%s\\n" "${{MEGATRON_ARGS[@]}}"'],
        capture_output=True, text=True, check=True, env=env)
    args = printed.stdout.split("\n")
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
        have_apex = True
    except Exception:
        have_apex = False
    turned_off = "--no-gradient-accumulation-fusion" in args
    assert "--transformer-impl" not in args  # TE: Megatron-LM's default layers
    assert turned_off == (expected and not have_apex)
    assert ("launch: Apex's fused_weight_gradient_mlp_cuda does not import" in printed.stderr) == turned_off
