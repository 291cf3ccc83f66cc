"""Architecture rules as tests: torch-free bookkeeping, one-way imports, lazy optional deps."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"

TORCH_FREE = [  # every bookkeeping module (all of pagedkv.core) and the description layer below it
    "pagedkv",
    "pagedkv.dtype",
    "pagedkv.params",
    *sorted("pagedkv.params." + p.stem for p in (SRC / "params").glob("*.py") if p.stem != "__init__"),
    "pagedkv.lazy",
    "pagedkv.interface",
    "pagedkv.specs",
    "pagedkv.offload.format",
    "pagedkv.offload.tier_index",
    "pagedkv.offload.tier_stats",
    *sorted(
        ".".join(("pagedkv", *p.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        for p in (SRC / "core").rglob("*.py")
    ),  # fmt: skip
]

# Lower number = lower layer. A module may import only from its own layer or below.
LAYERS = {
    "pagedkv.dtype": 0, "pagedkv.lazy": 0, "pagedkv.params": 0, "pagedkv.interface": 0, "pagedkv.specs": 0,
    "pagedkv.core": 1, "pagedkv.runtime": 2, "pagedkv.manager": 2, "pagedkv.ops": 3, "pagedkv.offload": 2, "pagedkv.observability": 3,
    "pagedkv.ops.page_copy": 2,  # a buffer op the manager applies (imports nothing from pagedkv)
    "pagedkv.ops.state_runs": 2,  # checkpoint runs the manager copies (imports nothing from pagedkv)
    "pagedkv.engine": 4, "pagedkv.testing": 5, "pagedkv.bench": 5, "pagedkv.demos": 5, "pagedkv.workloads": 5, "pagedkv.hf": 4, "pagedkv.cli": 6, "pagedkv": 6,
    "pagedkv.integrations": 5,
    "pagedkv.router": 5,
}  # fmt: skip
# The seed API puts `allocate_buffers` on the params; it is the one call that reaches up to build something
# (lazily). The params also check `eviction_policy` against the pool's registry of policies (lazily).
ALLOWED_UPWARD = {
    ("pagedkv.params.kv", "pagedkv.core.pool"),
    ("pagedkv.params.kv", "pagedkv.runtime.buffers"),
    ("pagedkv.params.state", "pagedkv.runtime.state_buffers"),
    ("pagedkv.params.multi", "pagedkv.runtime.buffers"),
}


def _layer(module: str) -> int:
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)
    return LAYERS[best]


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, path))
    return out


def test_bookkeeping_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    __import__(name)\n"
        "import numpy as np, pagedkv\n"
        "p = pagedkv.KVCacheParams(dtype=pagedkv.DType.bfloat16, n_kv_heads=8, head_dim=128, num_layers=2,\n"
        "    devices=[pagedkv.DeviceRef.CPU()], page_size=16, enable_prefix_caching=True)\n"
        "bm = pagedkv.BlockManager(64, 16, enable_prefix_caching=True)\n"
        "c = pagedkv.TextContext('r', np.arange(40)); bm.claim('r'); bm.alloc(c); c.update(1); bm.step(c)\n"
        "bm.check_integrity(); assert bm.get_req_blocks('r') == [0, 1, 2]\n"
        "assert len(p.get_symbolic_inputs().flatten()) == 4\n"
        "try:\n"
        "    pagedkv.PagedKVCacheManager\n"
        "except ImportError:\n"
        "    print('tensor side needs torch: ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "tensor side needs torch: ok" in result.stdout


def _imports(path: Path, *, eager_only: bool = False) -> list[str]:
    """Modules imported anywhere in `path`; with `eager_only`, only those run at import time."""
    tree = ast.parse(path.read_text())
    if eager_only:  # module-level statements, minus function bodies and `if TYPE_CHECKING:` blocks
        eager = [s for s in tree.body if not isinstance(s, ast.FunctionDef | ast.ClassDef) and not _is_type_checking(s)]
        nodes = [n for stmt in eager for n in ast.walk(stmt)]
    else:
        nodes = list(ast.walk(tree))
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _is_type_checking(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)


@pytest.mark.parametrize("module,path", _modules(), ids=[m for m, _ in _modules()])
def test_imports_flow_one_way(module: str, path: Path) -> None:
    if module == "pagedkv":
        return  # the package facade re-exports everything lazily
    for imported in _imports(path):
        if imported.startswith("pagedkv") and imported != "pagedkv":
            if (module, imported) in ALLOWED_UPWARD:
                continue
            assert _layer(imported) <= _layer(module), f"{module} (layer {_layer(module)}) imports {imported}"
    # Bookkeeping (core) never imports torch; the description layer only inside `to_torch`-style functions.
    strict = module.startswith("pagedkv.core")
    for imported in _imports(path, eager_only=not strict) if _layer(module) <= 1 else []:
        assert imported.split(".")[0] != "torch", f"bookkeeping module {module} imports torch"


def test_the_library_never_imports_the_research_harness() -> None:
    """benchmarks/ (the repository's research harness, `python -m benchmarks.<name>`) is not installed with
    the package: nothing in pagedkv may import it."""
    offenders = {m: i for m, p in _modules() for i in _imports(p) if i.split(".")[0] == "benchmarks"}
    assert not offenders, offenders


def test_files_hold_one_responsibility() -> None:
    """A file is as long as its one responsibility needs: a class is never split into mixins to keep
    files short. About 500 lines is the target (a review note, docs/DEVELOPERS.md); 700 is where a file
    has surely grown a second responsibility."""
    big = {m: n for m, p in _modules() if (n := len(p.read_text().splitlines())) > 700}
    assert not big, f"modules over 700 lines: {big}"


def _import_graph() -> dict[str, set[str]]:
    """module -> pagedkv modules it imports anywhere (functions and TYPE_CHECKING blocks included);
    importing ``a.b.c`` also runs the packages ``a.b`` on the way."""
    modules = dict(_modules())

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if name.startswith("pagedkv.") and (target := resolve(name)) is not None:
                    targets.add(target)
        for target in list(targets):
            parts = target.split(".")
            for i in range(2, len(parts)):  # the packages a dotted import runs first
                package = ".".join(parts[:i])
                if package in modules and not module.startswith(package):
                    targets.add(package)
        targets.discard(module)
        graph[module] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_but_the_seed_apis_one() -> None:
    """Modules that import each other, directly or through others: only `KVCacheParams.allocate_buffers`
    (MAX's API puts buffer allocation on the params), which reaches up to the runtime buffers."""
    allowed = [
        "pagedkv.params.multi",
        "pagedkv.params.kv",
        "pagedkv.runtime.buffers",
        "pagedkv.params.state",
        "pagedkv.runtime.state_buffers",
    ]
    circles = _circles(_import_graph())
    assert all(set(c) <= set(allowed) for c in circles), f"import circles: {circles}"


def test_the_circle_checker_finds_circles() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _declares_foreign_state(cls: ast.ClassDef) -> list[str]:
    """Bare class-level annotations (``_reqs: dict[...]``) that no method of `cls` assigns: state the
    class re-declares from a host it is mixed into. Dataclasses, ABCs, Protocols and NamedTuples declare
    their own fields that way and are skipped."""
    decorators = [ast.unparse(d) for d in cls.decorator_list]
    bases = [ast.unparse(b) for b in cls.bases]
    if any("dataclass" in d for d in decorators) or any(
        b in ("ABC", "Protocol", "NamedTuple", "TypedDict") for b in bases
    ):
        return []
    declared = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and s.value is None
                and isinstance(s.target, ast.Name)]  # fmt: skip
    assigned = {
        t.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for t in ([*t.elts] if isinstance(t, ast.Tuple) else [t])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")
    }
    return [name for name in declared if name not in assigned]


def test_no_class_redeclares_a_hosts_state() -> None:
    offenders = {}
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (names := _declares_foreign_state(node)):
                offenders[f"{module}.{node.name}"] = names
    assert not offenders, f"classes declaring state they never set (mixins of a host): {offenders}"


def test_the_bookkeeping_tests_pass_without_torch() -> None:
    """tests/core mirrors src/pagedkv/core: its tests run in a process where `import torch` fails."""
    env = {**os.environ, "PAGEDKV_WITHOUT_TORCH": "1"}
    tests = Path(__file__).resolve().parent
    result = subprocess.run([sys.executable, "-m", "pytest", str(tests / "core"), "-p", "no:cacheprovider"],
                            capture_output=True, text=True, env=env, cwd=tests.parent)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout and " skipped" not in result.stdout


def test_tests_mirror_the_source_tree() -> None:
    """Each test folder is named after the package (or top-level module group) it tests."""
    tests = Path(__file__).resolve().parent
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.name for p in tests.parent.iterdir() if (p / "__init__.py").exists()}  # benchmarks/ (not shipped)
    cross_cutting = {"hardening", "peers"}  # whole-stack fuzzing and hostile input; the real peers' classes
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders - packages <= cross_cutting, f"test folders with no source package: {folders - packages}"
