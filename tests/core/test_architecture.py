"""Architecture rules as tests: torch-free bookkeeping, one-way imports, lazy optional deps."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "pagedkv"

TORCH_FREE = [
    "pagedkv",
    "pagedkv.dtype",
    "pagedkv.params",
    "pagedkv.multi_params",
    "pagedkv.symbols",
    "pagedkv.records",
    "pagedkv.validation",
    "pagedkv.core.errors",
    "pagedkv.core.hashing",
    "pagedkv.core.block_pool",
    "pagedkv.core.pool_queries",
    "pagedkv.core.evictor",
    "pagedkv.core.arc",
    "pagedkv.core.pool_retention",
    "pagedkv.core.block_queries",
    "pagedkv.core.block_checks",
    "pagedkv.core.context",
    "pagedkv.core.metrics",
    "pagedkv.core.block_manager",
    "pagedkv.core.partial_pages",
    "pagedkv.core.memory",
    "pagedkv.core.events",
    "pagedkv.core.block_hooks",
    "pagedkv.core.tier_index",
    "pagedkv.core.tier_stats",
    "pagedkv.core.swap",
    "pagedkv.connector_config",
    "pagedkv.offload.format",
]

# Lower number = lower layer. A module may import only from its own layer or below.
LAYERS = {
    "pagedkv.dtype": 0, "pagedkv.validation": 0, "pagedkv.records": 0, "pagedkv.symbols": 0, "pagedkv.params": 0, "pagedkv.params_checks": 0, "pagedkv.deployment_seed": 0, "pagedkv.multi_params": 0, "pagedkv.interface": 0, "pagedkv.connector_config": 0,
    "pagedkv.core": 1, "pagedkv.runtime": 2, "pagedkv.manager": 2, "pagedkv.ops": 3, "pagedkv.offload": 2, "pagedkv.observability": 3,
    "pagedkv.ops.page_copy": 2,  # a buffer op the manager applies (imports nothing from pagedkv)
    "pagedkv.engine": 4, "pagedkv.testing": 5, "pagedkv.bench": 5, "pagedkv.demo": 5, "pagedkv.tier_demo": 5, "pagedkv.manager_demo": 5, "pagedkv.hf": 4, "pagedkv.cli": 6, "pagedkv": 6,
}  # fmt: skip
# The seed API puts `allocate_buffers` on the params; it is the one call that reaches up (lazily).
ALLOWED_UPWARD = {("pagedkv.params", "pagedkv.runtime.buffers"), ("pagedkv.multi_params", "pagedkv.runtime.buffers")}


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


def test_files_stay_small() -> None:
    big = {m: len(p.read_text().splitlines()) for m, p in _modules() if len(p.read_text().splitlines()) > 350}
    assert not big, f"modules over 350 lines: {big}"
