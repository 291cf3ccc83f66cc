"""`python -m benchmarks.<name>`: every research benchmark's command line, its flags and their help."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.command import BENCHMARKS, parser
from pagedkv.cli import BENCH_COMMANDS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_takes_json_and_plots_where_it_has_tables(name: str, tmp_path: Path) -> None:
    p = parser(name)
    assert p.prog == f"python -m {name}"
    assert p.parse_args(["--json", str(tmp_path / "r.json")]).json == tmp_path / "r.json"
    if BENCHMARKS[name].tables:
        assert p.parse_args(["--plots", str(tmp_path / "plots")]).plots == tmp_path / "plots"
    else:
        assert "--plots" not in p._option_string_actions
    for action in p._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_runs_as_a_module(name: str) -> None:
    """``python -m <name>`` reaches `benchmarks.command.main`: the module (or the package's __main__) says so."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin)
    source = (path.with_name("__main__.py") if path.name == "__init__.py" else path).read_text()
    assert f'main("{name}"' in source


def test_python_m_runs_from_the_repository_root() -> None:
    """The headline check end to end, as the docs run it: `python -m benchmarks.headline --check` from the root."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.headline", "--check"], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    help_ = subprocess.run([sys.executable, "-m", "benchmarks.compare", "--help"], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)  # fmt: skip
    assert help_.returncode == 0 and "usage: python -m benchmarks.compare" in help_.stdout, help_.stderr[-2000:]


def test_the_research_benchmarks_left_pagedkv_bench(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.cli import main as pagedkv_main

    assert not {name.rsplit(".", 1)[-1].replace("_", "-") for name in BENCHMARKS} & set(BENCH_COMMANDS)
    with pytest.raises(SystemExit) as exit_:
        pagedkv_main(["bench", "compare"])
    assert exit_.value.code == 2 and "invalid choice: 'compare'" in capsys.readouterr().err
