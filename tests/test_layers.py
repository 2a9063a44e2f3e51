"""Import rules of the package, checked statically: every .py file under megatron_dmuon/ is
parsed (nothing is imported) and ALL its imports are collected, the lazy ones inside functions
too, relative ones resolved to module names.

(a) no import cycle between megatron_dmuon modules;
(b) megatron-core (``megatron``, ``megatron.*``) is imported only by megatron/, testing/ (with the
    self-test commands verify_cli.py / check_cli.py) and the console script cli.py;
(c) no production module imports ``megatron_dmuon.testing`` (only testing/ itself does; its
    self-tests are their own console scripts, ``dmuon-verify`` / ``dmuon-check``);
(d) only decentralized/ imports ``megatron_dmuon.decentralized``, and decentralized/ takes
    nothing from the DMuon path but the math of algorithms/;
(e) the layers import only downward: algorithms < kernels < planning < runtime < megatron
    (and none of them imports the console script cli.py);
(f) planning/ is pure data: it imports only algorithms/ of the package, and outside it only the
    standard library, torch, numpy, scipy and mip (python-mip);
(g) no module imports or calls another module's private ``_names`` (KNOWN_PRIVATE_REACHES lists
    those still reached, each with why);
(g') no module writes a private attribute of an object other than its own ``self`` / ``cls``
    (KNOWN_PRIVATE_WRITES lists those still written, each with why);
(h) the ``--dmuon-overlap-step`` mode names are compared only in planning/overlap_mode.py;
(i) the ``--dmuon-mode`` names are compared nowhere: production code asks megatron/modes.py's traits;
(j) the update rule's names are compared only in algorithms/update_rule.py, the balance's only in
    planning/owner_layout.py;
(k) below megatron/ (algorithms, kernels, planning, runtime) nothing names a ``--dmuon-*`` / ``--muon-*``
    flag but the modules that are command lines (planning/plan_cli.py).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import sys
from pathlib import Path

PACKAGE = "megatron_dmuon"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

# (importer, imported) module names that break a rule in files being fixed in [structure]:
# exempt from every check below until then. Empty it as the fixes land (an entry whose import
# is gone fails test_known_violations_are_still_in_the_code).
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()

LAYERS = ("algorithms", "kernels", "planning", "runtime", "megatron", "bridge")
TOOLS = (f"{PACKAGE}.cli",)
MEGATRON_CORE_IMPORTERS = (f"{PACKAGE}.megatron", f"{PACKAGE}.testing", *TOOLS)
# Megatron-Bridge: one module imports it, in megatron/bridge/ beside the Megatron-LM hook (bridge.py, the door users import, does not)
BRIDGE_IMPORTER = f"{PACKAGE}.megatron.bridge.adapter"
TESTING = f"{PACKAGE}.testing"
TESTING_IMPORTERS = (TESTING,)
DECENTRALIZED = f"{PACKAGE}.decentralized"
DECENTRALIZED_MAY_IMPORT = (DECENTRALIZED, f"{PACKAGE}.algorithms")
PLANNING = f"{PACKAGE}.planning"
# json_store: the one on-disk store of the kernels' and the planner's caches (standard library only)
PLANNING_MAY_IMPORT = (PLANNING, f"{PACKAGE}.algorithms", f"{PACKAGE}.json_store", f"{PACKAGE}.files")  # (stdlib only)
# (matplotlib: only planning/plan_plot.py, dmuon plan's --plot, imported when asked)
PLANNING_THIRD_PARTY = ("torch", "numpy", "scipy", "mip", "matplotlib")


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} imports {self.imported} (line {self.line})"


def within(name: str, prefix: str) -> bool:
    """``name`` is ``prefix`` or inside it (``megatron_dmuon`` is not inside ``megatron``)."""
    return name == prefix or name.startswith(prefix + ".")


def within_any(name: str, prefixes) -> bool:
    return any(within(name, p) for p in prefixes)


def package_modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Module name -> file, a package being its ``__init__.py``."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(module: str, is_package: bool, source: str, known_modules) -> list[Import]:
    """Every import statement of ``source`` anywhere in the file (functions, try blocks, ...).

    ``from X import a`` counts as importing ``X.a`` when that is a module, else ``X``.
    """
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.append(Import(module, submodule if submodule in known_modules else target, node.lineno))
    return found


def all_imports() -> list[Import]:
    modules = package_modules()
    found = []
    for name, path in modules.items():
        found += imports_of(name, path.name == "__init__.py", path.read_text(), modules)
    return found


def checked_imports() -> list[Import]:
    return [i for i in all_imports() if (i.importer, i.imported) not in KNOWN_VIOLATIONS]


def internal_edges(imports: list[Import]) -> dict[str, dict[str, int]]:
    """importer -> {imported module: line}. Importing ``a.b.c`` also runs the ``__init__`` of
    ``a.b`` unless that package is already being imported (an ancestor of the importer)."""
    edges: dict[str, dict[str, int]] = {}
    for i in imports:
        if not within(i.imported, PACKAGE):
            continue
        targets = {i.imported}
        parts = i.imported.split(".")
        for n in range(2, len(parts)):
            ancestor = ".".join(parts[:n])
            if not within(i.importer, ancestor):
                targets.add(ancestor)
        for target in targets:
            edges.setdefault(i.importer, {}).setdefault(target, i.line)
    return edges


def find_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (Tarjan, then a BFS inside)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, {}):
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        start = min(component)
        parents, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in edges.get(v, {})]:
            nxt = []
            for v in frontier:
                for w in sorted(edges.get(v, {})):
                    if w in component and w not in parents:
                        parents[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in edges.get(v, {}))
        path = [last]
        while parents[path[-1]] is not None:
            path.append(parents[path[-1]])
        cycles.append(path[::-1] + [start])
    return cycles


def describe_cycle(cycle: list[str], edges) -> str:
    return " -> ".join(
        [cycle[0]] + [f"{b} (line {edges[a][b]} of {a})" for a, b in zip(cycle, cycle[1:])]
    )


def layer_rank(module: str) -> int | None:
    for rank, layer in enumerate(LAYERS):
        if within(module, f"{PACKAGE}.{layer}"):
            return rank
    if within_any(module, TOOLS):
        return len(LAYERS)
    return None


def _report(bad: list[Import], rule: str) -> str:
    return f"{rule}:\n" + "\n".join(f"  {i}" for i in bad)


def test_collector_sees_lazy_relative_and_submodule_imports():
    source = (
        "from . import sibling\n"
        "from ..other import helper\n"
        "import torch\n"
        "def f():\n"
        "    from ..other.deep import thing\n"
        "    import megatron.core as mc\n"
    )
    known = {"pkg", "pkg.sub", "pkg.sub.mod", "pkg.sub.sibling", "pkg.other", "pkg.other.deep"}
    found = {(i.imported, i.line) for i in imports_of("pkg.sub.mod", False, source, known)}
    assert found == {("pkg.sub.sibling", 1), ("pkg.other", 2), ("torch", 3), ("pkg.other.deep", 5), ("megatron.core", 6)}
    # In a package's __init__, '.' is the package itself.
    assert [i.imported for i in imports_of("pkg.sub", True, "from .mod import x", known)] == ["pkg.sub.mod"]


def test_collector_covers_the_package():
    imports = all_imports()
    pairs = {(i.importer, i.imported) for i in imports}
    assert len(package_modules()) > 30
    # Known edges of each kind: relative top-level, lazy, and megatron-core in megatron/.
    assert (f"{PACKAGE}.kernels.ns_driver", f"{PACKAGE}.algorithms.newton_schulz") in pairs
    assert (f"{PACKAGE}.kernels.autotune", f"{PACKAGE}.kernels.triton_symmetric") in pairs  # inside functions
    assert any(within(i.importer, f"{PACKAGE}.megatron") and within(i.imported, "megatron") for i in imports)


def test_find_cycles_reports_the_path():
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"d": 4}, "e": {"a": 5}}
    cycles = sorted(find_cycles(edges))
    assert cycles == [["a", "b", "c", "a"], ["d", "d"]]
    assert describe_cycle(cycles[0], edges) == "a -> b (line 1 of a) -> c (line 2 of b) -> a (line 3 of c)"
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles():
    edges = internal_edges(checked_imports())
    cycles = find_cycles(edges)
    assert not cycles, "import cycles between megatron_dmuon modules:\n" + "\n".join(
        "  " + describe_cycle(c, edges) for c in cycles
    )


def test_megatron_core_only_in_megatron_testing_and_tools():
    bad = [
        i for i in checked_imports()
        if within(i.imported, "megatron") and not within_any(i.importer, MEGATRON_CORE_IMPORTERS)
    ]
    assert not bad, _report(bad, "megatron-core imported outside megatron/, testing/, verify.py, cli.py")


def test_megatron_bridge_only_in_the_bridge_adapter():
    imports = checked_imports()
    bad = [i for i in imports if within(i.imported, "megatron.bridge") and i.importer != BRIDGE_IMPORTER]
    assert not bad, _report(bad, f"megatron.bridge imported outside {BRIDGE_IMPORTER}")
    assert any(i.importer == BRIDGE_IMPORTER and within(i.imported, "megatron.bridge") for i in imports)


def test_production_code_does_not_import_testing():
    bad = [
        i for i in checked_imports()
        if within(i.imported, TESTING) and not within_any(i.importer, TESTING_IMPORTERS)
    ]
    assert not bad, _report(bad, "megatron_dmuon.testing imported by production code")


def test_only_decentralized_imports_decentralized():
    bad = [
        i for i in checked_imports()
        if within(i.imported, DECENTRALIZED) and not within(i.importer, DECENTRALIZED)
    ]
    assert not bad, _report(bad, "megatron_dmuon.decentralized imported from outside it")


def test_decentralized_takes_only_the_algorithms_math():
    bad = [
        i for i in checked_imports()
        if within(i.importer, DECENTRALIZED) and within(i.imported, PACKAGE)
        and not within_any(i.imported, DECENTRALIZED_MAY_IMPORT)
    ]
    assert not bad, _report(bad, "decentralized/ imports more of the package than algorithms/")


def test_layers_import_only_downward():
    bad = []
    for i in checked_imports():
        importer, imported = layer_rank(i.importer), layer_rank(i.imported)
        if importer is not None and imported is not None and imported > importer:
            bad.append(i)
    assert not bad, _report(bad, f"a layer imports a higher one (order: {' < '.join(LAYERS)} < cli/verify)")


def test_known_violations_are_still_in_the_code():
    """Each KNOWN_VIOLATIONS entry is still an import somewhere (else remove it from the set)."""
    pairs = {(i.importer, i.imported) for i in all_imports()}
    stale = sorted(KNOWN_VIOLATIONS - pairs)
    assert not stale, f"KNOWN_VIOLATIONS entries no longer in the code, remove them: {stale}"


def test_planning_imports_only_algorithms_and_its_libraries():
    bad = []
    for i in checked_imports():
        if not within(i.importer, PLANNING):
            continue
        top = i.imported.split(".")[0]
        if within(i.imported, PACKAGE):
            ok = within_any(i.imported, PLANNING_MAY_IMPORT)
        else:
            ok = top == "__future__" or top in sys.stdlib_module_names or top in PLANNING_THIRD_PARTY
        if not ok:
            bad.append(i)
    assert not bad, _report(bad, "planning/ imports more than algorithms/, the standard library, "
                                 f"{', '.join(PLANNING_THIRD_PARTY)}")


def test_nothing_in_the_repository_cites_files_a_clone_does_not_have():
    """Code, docs and results cite public sources (a paper, a repository and path, a file in
    docs/results); the development notes beside a checkout (its MISSION/FACTS pages, the shared folder) are
    not in a user's clone, so no file names them."""
    root = PACKAGE_DIR.parent
    pattern = ("MISSION" + ".md", "FACTS" + ".md", "../" + "shared")
    found = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if rel.parts[0] in (".git", ".venv", ".whl", ".te", ".apex", ".mlm") or "__pycache__" in rel.parts \
                or not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{rel}: {p}" for p in pattern if p in text]
    assert not found, "\n".join(found)


# --- private names stay in their module ----------------------------------------------------------
# A module's ``_name`` is its own business: no other module of the package imports it (``from X
# import _name``) or calls it (``obj._name(...)``, where ``_name`` is defined in the package but not
# in the calling module; ``self``, ``cls`` and ``super()`` are the class's own). Names the package
# does not define (megatron-core's ``_get_param_groups_and_buffers``, torch's ``_foreach_mul_``) are
# outside this rule: the project must use those APIs as they are.
# (module, private name) -> why it is still reached from outside; an entry no longer in the code
# fails test_known_private_reaches_are_still_in_the_code.
KNOWN_PRIVATE_REACHES: dict[tuple[str, str], str] = {
    # megatron-core's DistributedOptimizer method (DMuon's owner optimizer overrides it): Megatron's API
    (f"{PACKAGE}.megatron.checkpoint.optimizer_state", "_copy_main_params_to_model_params"):
        "megatron-core's DistributedOptimizer API, called on a part after a load",
    # testing/: the self-test workers share one harness's helpers (not production code)
    **{(f"{PACKAGE}.testing.{m}", n): "the test workers' shared harness"
       for m, names in {"checkpoint_workers": ("_build", "_finish_overlap", "_report", "_train"),
                        "guard_workers": ("_build", "_finish_overlap", "_micro_batches", "_report", "_train"),
                        "mixed_precision": ("_build", "_finish_overlap", "_report"),
                        "overlap_workers": ("_concat", "_load", "_save", "_build", "_finish_overlap", "_report", "_train"),
                        "qk_clip_workers": ("_build", "_finish_overlap", "_report", "_train"),
                        "switch_workers": ("_same", "_snapshot", "_muon_settings", "_shape", "_split_kwargs", "_build",
                                           "_finish_overlap", "_train"),
                        "workers": ("_tp_of",)}.items() for n in names},
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_private_names(source: str) -> set[str]:
    """Every ``_name`` a module defines: functions, methods, classes, assigned names and attributes."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if _is_private(n)}


def private_reaches(module: str, is_package: bool, source: str, package_private: set[str]) -> list[tuple[str, int]]:
    """(private name, line) of every import of another package module's ``_name``, and of every call
    ``obj._name(...)`` of a package-defined ``_name`` this module does not define itself."""
    own = defined_private_names(source)
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            target = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else [])) \
                if node.level else node.module
            if within(target or "", PACKAGE):
                found += [(a.name, node.lineno) for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_private(node.func.attr):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if node.func.attr in package_private and node.func.attr not in own:
                found.append((node.func.attr, node.lineno))
    return found


@functools.lru_cache(maxsize=1)  # (read-only: two tests walk the same files)
def all_private_reaches() -> dict[tuple[str, str], list[int]]:
    modules = package_modules()
    sources = {name: path.read_text() for name, path in modules.items()}
    package_private = set().union(*(defined_private_names(s) for s in sources.values()))
    found: dict[tuple[str, str], list[int]] = {}
    for name, source in sources.items():
        for private, line in private_reaches(name, modules[name].name == "__init__.py", source, package_private):
            found.setdefault((name, private), []).append(line)
    return found


def test_private_reach_finder_sees_imports_and_calls():
    source = (
        "from .other import _helper, public\n"
        "from torch import _foreach_mul_\n"
        "def _mine(): pass\n"
        "class A:\n"
        "    def f(self, opt):\n"
        "        self._own()\n"
        "        super()._base()\n"
        "        _mine()\n"
        "        opt._fill(1)\n"
        "        opt._mine()\n"
        "        opt._not_ours()\n"
    )
    found = private_reaches(f"{PACKAGE}.sub.mod", False, source, {"_helper", "_fill", "_mine", "_own", "_base"})
    assert found == [("_helper", 1), ("_fill", 9)]


def test_no_module_reaches_into_another_modules_private_names():
    bad = {k: v for k, v in all_private_reaches().items() if k not in KNOWN_PRIVATE_REACHES}
    assert not bad, "a module imports or calls another module's private name (make it public, or a method " \
                    "of the object that owns it):\n" + "\n".join(f"  {m}: {n} (lines {v})" for (m, n), v in sorted(bad.items()))


def test_known_private_reaches_are_still_in_the_code():
    stale = sorted(set(KNOWN_PRIVATE_REACHES) - set(all_private_reaches()))
    assert not stale, f"KNOWN_PRIVATE_REACHES entries no longer in the code, remove them: {stale}"


# --- a private attribute is written only by its own object ----------------------------------------
# ``obj._name = ...`` (or ``+=``, an annotated assignment, ``del``, ``setattr`` / ``delattr`` with a
# constant name) is a hidden channel between modules unless ``obj`` is the ``self`` / ``cls`` of the
# method it is written in: the first parameter of a function defined in a class body (a function
# nested in that method shares it). Dunders (``__name__``) are not private. A ``setattr`` whose name is
# computed is not judged here. (module, written target) -> why it is still written from outside; an
# entry no longer in the code fails test_known_private_writes_are_still_in_the_code.
KNOWN_PRIVATE_WRITES: dict[tuple[str, str], str] = {
    (f"{PACKAGE}.megatron.checkpoint.switch", "base_owner._load_base_checkpoint"):
        "the optimizer switch inside Megatron-LM's / Megatron-Bridge's own checkpoint load: their read of the "
        "common state has no public seam (route_checkpoint_loads, idempotent, documented in docs/megatron_lm.md)",
    (f"{PACKAGE}.megatron.checkpoint.switch", "cls._set_main_param_and_optimizer_states"):
        "megatron-core 0.19's DistributedOptimizer without Apex/TE fails a load (megatron_torch_adam_load: "
        "replaced for that one load, restored after it)",
    (f"{PACKAGE}.testing.cpu_shim", "mp_random._set_cuda_rng_state"):
        "the tests' CPU shim: megatron-core's CUDA RNG helpers have no CPU path and no seam",
    (f"{PACKAGE}.testing.cpu_shim", "mp_random._get_cuda_rng_state"):
        "the tests' CPU shim: megatron-core's CUDA RNG helpers have no CPU path and no seam",
}


def private_writes(source: str) -> list[tuple[str, int]]:
    """(written target, line) of every write of a private attribute on anything but the ``self`` /
    ``cls`` of the method the write is in."""
    found = []

    def target_of(node, own) -> str | None:
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not (
                isinstance(node.value, ast.Name) and node.value.id in own):
            return ast.unparse(node)
        return None

    def visit(node, own: frozenset, in_class: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            params = node.args.posonlyargs + node.args.args
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in getattr(node, "decorator_list", ()))
            if in_class and params and not static:
                own = own | {params[0].arg}
            for child in ast.iter_child_nodes(node):
                visit(child, own, False)
            return
        if isinstance(node, ast.ClassDef):
            for child in ast.iter_child_nodes(node):
                visit(child, own, True)
            return
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        while any(isinstance(t, (ast.Tuple, ast.List, ast.Starred)) for t in targets):
            targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else
                                                    [t.value] if isinstance(t, ast.Starred) else [t])]
        found.extend((t, node.lineno) for t in (target_of(t, own) for t in targets) if t)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _is_private(node.args[1].value) and not (
                    isinstance(node.args[0], ast.Name) and node.args[0].id in own):
            found.append((f"{ast.unparse(node.args[0])}.{node.args[1].value}", node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, own, in_class)

    visit(ast.parse(source), frozenset(), False)
    return found


@functools.lru_cache(maxsize=1)
def all_private_writes() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for name, path in package_modules().items():
        for target, line in private_writes(path.read_text()):
            found.setdefault((name, target), []).append(line)
    return found


def test_private_write_finder_sees_writes_outside_their_object():
    source = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._mine = 1\n"
        "        other._theirs = 2\n"
        "        def nested():\n"
        "            self._still_mine = 3\n"
        "        self.part._deep = 4\n"
        "    @classmethod\n"
        "    def g(cls):\n"
        "        cls._registry = {}\n"
        "    @staticmethod\n"
        "    def h(self):\n"
        "        self._not_an_instance = 5\n"
        "def patch(module, cls):\n"
        "    module._hook = None\n"
        "    cls._method = None\n"
        "    setattr(module, '_flag', True)\n"
        "    a, module._pair = 1, 2\n"
        "    module.__name__ = 'x'\n"
        "    module._count += 1\n"
        "    del module._gone\n"
    )
    assert private_writes(source) == [
        ("other._theirs", 4), ("self.part._deep", 7), ("self._not_an_instance", 13), ("module._hook", 15),
        ("cls._method", 16), ("module._flag", 17), ("module._pair", 18), ("module._count", 20), ("module._gone", 21)]


def test_no_module_writes_another_objects_private_attributes():
    bad = {k: v for k, v in all_private_writes().items() if k not in KNOWN_PRIVATE_WRITES}
    assert not bad, "a private attribute written from outside its object (pass an explicit object, or make it a " \
                    "method of the object that owns it):\n" + \
        "\n".join(f"  {m}: {t} (lines {v})" for (m, t), v in sorted(bad.items()))


def test_known_private_writes_are_still_in_the_code():
    stale = sorted(set(KNOWN_PRIVATE_WRITES) - set(all_private_writes()))
    assert not stale, f"KNOWN_PRIVATE_WRITES entries no longer in the code, remove them: {stale}"


# --- a flag's value names are compared only where the flag's meaning lives --------------------------
def name_comparisons(source: str, names, unique_names, subject: str, table: str = "") -> list[int]:
    """Lines comparing a flag's value by its name: a comparison of something whose code mentions
    ``subject`` with one of ``names`` (or a tuple, list or set of them), any comparison with a name no
    other setting of the package spells (``unique_names``, alone or inside a collection), or a
    membership test in the flag's ``table`` of names."""

    def literal(node, pool, every: bool) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in pool
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and \
            (all if every else any)(literal(e, pool, every) for e in node.elts)

    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any((table and table in ast.unparse(o)) or literal(o, unique_names, False) for o in operands):
            lines.append(node.lineno)
        elif any(literal(o, names, True) for o in operands) and any(
                subject in ast.unparse(o).lower() for o in operands if not literal(o, names, True)):
            lines.append(node.lineno)
    return lines


OVERLAP_MODE_MODULE = f"{PACKAGE}.planning.overlap_mode"
OVERLAP_MODE_NAMES = ("off", "on", "sync", "backward")
OVERLAP_ONLY_NAMES = ("sync", "backward")  # no other setting of the package is spelled so


def overlap_mode_comparisons(source: str) -> list[int]:
    """--dmuon-overlap-step's names compared: with something named ``*overlap*``, 'sync' or
    'backward' anywhere, or a membership test in ``OVERLAP_STEP_MODES``."""
    return name_comparisons(source, OVERLAP_MODE_NAMES, OVERLAP_ONLY_NAMES, "overlap", "OVERLAP_STEP_MODES")


def test_overlap_mode_comparison_finder():
    source = (
        "a = args.overlap_step == 'on'\n"
        "b = overlap in ('on', 'backward')\n"
        "c = mode == 'off'\n"  # another mode (the simulation's): not this flag
        "d = name not in OVERLAP_STEP_MODES\n"
        "e = OverlapMode(args.dmuon_overlap_step).overlaps\n"
        "f = mode.name == 'backward'\n"
    )
    assert overlap_mode_comparisons(source) == [1, 2, 4, 6]


def test_overlap_mode_names_are_compared_in_one_module():
    """--dmuon-overlap-step's meaning lives in planning/overlap_mode.py; everything else asks it."""
    modules = package_modules()
    found = {name: overlap_mode_comparisons(path.read_text()) for name, path in modules.items()}
    bad = {name: lines for name, lines in found.items() if lines and name != OVERLAP_MODE_MODULE}
    assert not bad, "overlap mode names compared outside planning/overlap_mode.py (use OverlapMode):\n" + \
        "\n".join(f"  {name}: lines {lines}" for name, lines in sorted(bad.items()))
    assert found[OVERLAP_MODE_MODULE], "the finder no longer sees OverlapMode's own comparisons"


# --- the --dmuon-mode names are compared nowhere: what a mode needs is in megatron/modes.py --------
DMUON_MODE_NAMES = ("dmuon", "gather_then_compute", "megatron_layerwise")
DMUON_BASELINE_NAMES = ("gather_then_compute", "megatron_layerwise")  # no other setting is spelled so


def dmuon_mode_comparisons(source: str) -> list[int]:
    """--dmuon-mode's names compared: with something named ``*mode*``, or a baseline's name anywhere."""
    return name_comparisons(source, DMUON_MODE_NAMES, DMUON_BASELINE_NAMES, "mode")


def test_dmuon_mode_comparison_finder():
    source = (
        "a = cfg.mode == 'dmuon'\n"
        "b = args.dmuon_mode != 'megatron_layerwise'\n"
        "c = args.optimizer == 'dmuon'\n"  # the optimizer's name: not this flag
        "d = x in ('gather_then_compute', 'y')\n"
        "e = mode_traits(args.dmuon_mode).all_reduces\n"
    )
    assert dmuon_mode_comparisons(source) == [1, 2, 4]


def test_dmuon_mode_names_are_compared_nowhere():
    """A mode's needs (distributed optimizer, DDP, owner step, TP/EP, checkpoints, update rules, the
    Megatron-LM hook) are its ModeTraits; production code asks them instead of comparing names."""
    found = {name: dmuon_mode_comparisons(path.read_text()) for name, path in package_modules().items()
             if not name.startswith(f"{PACKAGE}.testing")}
    bad = {name: lines for name, lines in found.items() if lines}
    assert not bad, "--dmuon-mode names compared (ask megatron/modes.py's mode_traits):\n" + \
        "\n".join(f"  {name}: lines {lines}" for name, lines in sorted(bad.items()))


# --- the update rule's and the balance's names are compared where their meaning lives ----------------
UPDATE_RULE_MODULE = f"{PACKAGE}.algorithms.update_rule"
UPDATE_RULE_NAMES = ("muon", "normuon", "dion3")
ROW_RULE_NAMES = ("normuon", "dion3")  # no other setting is spelled so ('muon' is also the optimizer's name)
BALANCE_MODULE = f"{PACKAGE}.planning.owner_layout"
BALANCE_NAMES = ("cost", "round_robin", "numel_lpt", "megatron_lpt", "milp", "matrix_milp")
BALANCE_ONLY_NAMES = ("round_robin", "numel_lpt", "megatron_lpt", "matrix_milp")  # ('milp' is also a planner's)


def update_rule_comparisons(source: str) -> list[int]:
    """The update rule's names compared: with something named ``*update*``, or a row rule's name anywhere."""
    return name_comparisons(source, UPDATE_RULE_NAMES, ROW_RULE_NAMES, "update")


def balance_comparisons(source: str) -> list[int]:
    """The balance's names compared: with something named ``*balance*``, or a name only it spells."""
    return name_comparisons(source, BALANCE_NAMES, BALANCE_ONLY_NAMES, "balance")


def test_update_rule_and_balance_comparison_finders():
    source = (
        "a = s.update != 'muon'\n"
        "b = rule == 'dion3'\n"
        "c = config.optimizer == 'muon'\n"  # the optimizer's name: not this setting
        "d = s.rule.by_rows\n"
        "e = options.balance == 'milp'\n"
        "f = planner == 'milp'\n"  # dmuon plan's planner: not this setting
        "g = name in ('numel_lpt', 'x')\n"
    )
    assert update_rule_comparisons(source) == [1, 2]
    assert balance_comparisons(source) == [5, 7]


def test_update_rule_and_balance_names_are_compared_in_one_module_each():
    """--dmuon-update's meaning lives in algorithms/update_rule.py (UpdateRule), --dmuon-balance's in
    planning/owner_layout.py (BalanceMethod); everything else asks them."""
    for finder, home, fix in ((update_rule_comparisons, UPDATE_RULE_MODULE, "UpdateRule"),
                              (balance_comparisons, BALANCE_MODULE, "BalanceMethod")):
        found = {name: finder(path.read_text()) for name, path in package_modules().items()}
        bad = {name: lines for name, lines in found.items() if lines and name != home}
        assert not bad, f"names compared outside {home} (ask {fix}):\n" + \
            "\n".join(f"  {name}: lines {lines}" for name, lines in sorted(bad.items()))
        assert found[home], f"the finder no longer sees {fix}'s own comparisons"


# --- below megatron/, nothing names a command-line flag but the modules that are command lines -----
LOWER_LAYERS = tuple(f"{PACKAGE}.{layer}" for layer in ("algorithms", "kernels", "planning", "runtime"))
COMMAND_LINES = (f"{PACKAGE}.planning.plan_cli",)  # `dmuon plan`: its own flags mirror the job's


def test_no_flag_names_below_the_command_line():
    """The lower layers take the config's values, never the flags that set them: their errors name a
    field (megatron/config.py checks what users give, in the flags' words, once)."""
    bad = {name: [i for i, line in enumerate(path.read_text().splitlines(), 1) if "--dmuon-" in line or "--muon-" in line]
           for name, path in package_modules().items()
           if within_any(name, LOWER_LAYERS) and name not in COMMAND_LINES}
    bad = {name: lines for name, lines in bad.items() if lines}
    assert not bad, "flag names below megatron/ (name the config field; the flag's words belong to megatron/):\n" + \
        "\n".join(f"  {name}: lines {lines}" for name, lines in sorted(bad.items()))
