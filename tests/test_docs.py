"""Every ```python block of README.md and docs/*.md runs as written.

Each file's blocks run in order in one fresh interpreter (a subprocess per file, in an empty temporary
directory, with a timeout), so a later block may use what an earlier block of the same file defined and
no file sees another's names. ```bash and ```text blocks are not run: a block that is deliberately not
runnable must not be marked ```python. Blocks that start `redis-server` themselves (docs/TIERS.md,
docs/SECURITY.md...) skip without it, unless PAGEDKV_REQUIRE_REDIS=1 (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
TIMEOUT_S = 120

# Runs the blocks of one file in one namespace; a failure names the block and its first line in the file.
RUNNER = """
import json, sys, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for path, line, source in blocks:
    try:
        exec(compile(source, f"{path}:block@{line}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the python block at {path}:{line}", file=sys.stderr)
        sys.exit(1)
"""


def python_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(file, line of the block's first code line, code) of every ```python block, in order."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) == "python":
            line = text.count("\n", 0, match.start(2)) + 1
            blocks.append((str(path.relative_to(ROOT)), line, match.group(2)))
    return blocks


def fence_languages(path: Path) -> list[str]:
    return [m.group(1) for m in FENCE.finditer(path.read_text())]


FILES_WITH_PYTHON = [p for p in DOC_FILES if python_blocks(p)]


@pytest.mark.parametrize("path", FILES_WITH_PYTHON, ids=[str(p.relative_to(ROOT)) for p in FILES_WITH_PYTHON])
def test_python_blocks_run(path: Path, tmp_path: Path) -> None:
    blocks = python_blocks(path)
    if any("redis-server" in source for _, _, source in blocks) and shutil.which("redis-server") is None:
        if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":
            pytest.fail(f"{path.name} needs redis-server on PATH (PAGEDKV_REQUIRE_REDIS=1)")
        pytest.skip(f"{path.name} starts redis-server, which is not installed")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")  # no snippet may download anything
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER], input=json.dumps(blocks), capture_output=True, text=True,
        cwd=tmp_path, env=env, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, f"{path.name}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def test_every_fence_is_labelled() -> None:
    """A bare ``` fence opening a block would hide Python from this test: label it (python, bash, text).
    docs/ARCHITECTURE.md is exempt: its bare blocks are diagrams."""
    unlabelled = [p.name for p in DOC_FILES if p.name != "ARCHITECTURE.md" and "" in fence_languages(p)]
    assert not unlabelled, f"label every code block's language in {unlabelled}"


def test_readme_starts_with_make_demo_and_make_test() -> None:
    first = FENCE.search((ROOT / "README.md").read_text())
    assert first is not None and first.group(1) == "bash"
    commands = [c for c in (line.split("#")[0].strip() for line in first.group(2).splitlines()) if c]
    assert commands[:2] == ["make demo", "make test"]


def test_doc_links_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file of the repository."""
    missing = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                missing.append(f"{path.name}: {target}")
    assert not missing, missing


def test_every_dotted_pagedkv_name_resolves() -> None:
    """Every ``pagedkv.x.y`` the README and docs name (a module, or an attribute of one) exists, so
    prose cannot name a module or class that was moved or removed."""
    code = (
        "import importlib, json, sys\n"
        "bad = []\n"
        "for name in json.load(sys.stdin):\n"
        "    parts = name.split('.')\n"
        "    for i in range(len(parts), 0, -1):\n"
        "        try:\n"
        "            obj = importlib.import_module('.'.join(parts[:i]))\n"
        "            break\n"
        "        except ImportError:\n"
        "            continue\n"
        "    for attr in parts[i:]:\n"
        "        if not hasattr(obj, attr):\n"
        "            bad.append(name)\n"
        "            break\n"
        "        obj = getattr(obj, attr)\n"
        "print(json.dumps(bad))\n"
    )
    names = sorted({m.group(0).rstrip(".") for p in DOC_FILES
                    for m in re.finditer(r"\bpagedkv(\.[A-Za-z_][A-Za-z0-9_]*)+", p.read_text())})  # fmt: skip
    assert len(names) > 10
    result = subprocess.run([sys.executable, "-c", code], input=json.dumps(names), capture_output=True, text=True,
                            timeout=TIMEOUT_S, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [], f"names in the docs that do not exist: {result.stdout}"
