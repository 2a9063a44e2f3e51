"""Counts the assertions of the test suite, so that moving or merging tests can show none was dropped.

    python tests/count_assertions.py [--collected NODEIDS.txt]

Static sites, read from the source of every .py file under tests/ (test files, workers, conftest):
  - `assert` statements;
  - `pytest.raises(...)` / `pytest.warns(...)` (a refusal the test expects);
  - calls whose name starts with `assert_` (torch.testing.assert_close, np.testing.assert_array_equal,
    the suite's own assert_* helpers).
With --collected (the output of `pytest --collect-only -q`), the sites inside each test function are also
weighted by the number of items that function is collected as (its parametrize multiplicity); sites in
helpers and fixtures count once. A test that moves keeps its name, so the weighted count follows it."""
import argparse
import ast
import collections
import pathlib
import re
import sys

TESTS = pathlib.Path(__file__).resolve().parent


def _is_site(node: ast.AST) -> bool:
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("raises", "warns") and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "pytest":
            return True
        return name.startswith("assert_")
    return False


def _sites(node: ast.AST) -> int:
    return sum(1 for sub in ast.walk(node) if _is_site(sub))


def count(collected: dict[str, int] | None = None) -> dict[str, int]:
    files = sorted(p for p in TESTS.rglob("*.py") if p.name != pathlib.Path(__file__).name)
    static = weighted = test_functions = 0
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        file_sites = _sites(tree)
        static += file_sites
        in_tests = 0
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                test_functions += 1
                sites = _sites(node)
                in_tests += sites
                if collected is not None:
                    weighted += sites * max(1, collected.get(node.name, 0))
        weighted += file_sites - in_tests
    out = {"files": len(files), "test_functions": test_functions, "assertion_sites": static}
    if collected is not None:
        out["assertions_weighted_by_parametrize"] = weighted
        out["collected_items"] = sum(collected.values())
    return out


def _read_collected(path: str) -> dict[str, int]:
    per_function: collections.Counter = collections.Counter()
    for line in pathlib.Path(path).read_text().splitlines():
        match = re.match(r"^\S+\.py::(?:\w+::)*(\w+)(\[.*\])?$", line.strip())
        if match:
            per_function[match.group(1)] += 1
    return dict(per_function)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collected", help="output of `pytest --collect-only -q` (node ids, one a line)")
    args = parser.parse_args(argv)
    result = count(_read_collected(args.collected) if args.collected else None)
    for key, value in result.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
