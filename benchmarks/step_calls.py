"""How many pagedkv functions one `LLMEngine` decode step calls, per layer.

`count_step_calls` builds a tiny transformers Llama from a config with random
weights (`pagedkv.testing.build_llama`), prefills a few prompts, then profiles
`steps` decode steps with `sys.setprofile`: every call whose code object lives
in the pagedkv package counts once under its qualified name. The counts are
divided by steps and by layers, so a function that runs once per step shows
``1 / num_layers`` and one that runs once per layer shows ``1`` (or more when
it runs several times in a layer). `main()` prints the table (the bench CLI
wires it up).

The families the engine's "one decode step, one pass" design is about are
summed under `FAMILIES`: attention-option builds, argument validation,
position computations and host-to-device copies of the step's tables.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import pagedkv
from pagedkv.bench import report

__all__ = ["FAMILIES", "add_arguments", "command", "count_step_calls", "format_step_calls", "step_call_counts"]

_ROOT = str(Path(pagedkv.__file__).resolve().parent)
_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

# family -> qualified function names (module:qualname) that belong to it
FAMILIES: dict[str, tuple[str, ...]] = {
    "attention options": (
        "pagedkv.hf.attention:GroupContext.attention_options",
        "pagedkv.ops.masks:AttentionOptions.__init__",
    ),
    "validation": (
        "pagedkv.ops.checks:check_store",
        "pagedkv.ops.checks:check_attention",
        "pagedkv.ops.checks:check_step",
        "pagedkv.ops.checks:_check_inputs",
        "pagedkv.ops.checks:_check_tokens",
        "pagedkv.ops.masks:AttentionOptions.check",
        "pagedkv.ops.torch_ops:_check_query",
        "pagedkv.ops.triton_decode:_check",
        "pagedkv.ops.triton_decode:_check_arguments",
    ),
    "positions": ("pagedkv.ops.metadata:PagedMetadata.build",),
    "host-to-device copies": ("pagedkv.runtime.transfer:to_device",),
}


def _name(frame: FrameType) -> str:
    code = frame.f_code
    module = frame.f_globals.get("__name__", "?")
    return f"{module}:{getattr(code, 'co_qualname', code.co_name)}"


def step_call_counts(engine: Any, steps: int) -> Counter[str]:
    """Calls of pagedkv functions (module:qualname -> count) over `steps` calls of ``engine.step()``."""
    counts: Counter[str] = Counter()
    resumed: set[FrameType] = set()  # generator frames already counted (each resumption is a "call" event)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(_ROOT):
            if code.co_flags & _GENERATOR_FLAGS:
                if frame in resumed:
                    return
                resumed.add(frame)
            counts[_name(frame)] += 1
        elif code.co_name == "__init__":  # a dataclass's generated __init__ (its code lives in "<string>")
            cls = type(frame.f_locals.get("self"))
            if cls.__module__.startswith("pagedkv"):
                counts[f"{cls.__module__}:{cls.__qualname__}.__init__"] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        sys.setprofile(previous)
    counts.pop(f"{__name__}:step_call_counts.<locals>.profile", None)
    return counts


def count_step_calls(
    num_layers: int = 4, batch: int = 3, steps: int = 4, prompt_length: int = 12, page_size: int = 4
) -> dict[str, Any]:
    """Profile `steps` decode steps of a `batch`-request tiny Llama with `num_layers` layers (CPU).

    Returns ``{"num_layers", "steps", "per_layer_step": {function: calls / (steps * num_layers)},
    "families": {family: calls / (steps * num_layers)}, "per_step": {function: calls / steps}}``.
    """
    from pagedkv.engine import LLMEngine
    from pagedkv.testing import build_llama

    model = build_llama(
        0, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    engine = LLMEngine.from_hf(model, page_size=page_size, num_pages=64 + batch * 16, max_num_batched_tokens=512)
    for b in range(batch):
        engine.add_request([(7 * b + i) % 100 + 1 for i in range(prompt_length)], max_new_tokens=steps + 2)
    with torch.inference_mode():
        engine.step()  # the prefill; every later step decodes one token per request
        counts = step_call_counts(engine, steps)
    per_step = {name: n / steps for name, n in counts.items()}
    per_layer = {name: n / (steps * num_layers) for name, n in counts.items()}
    families = {family: sum(per_layer.get(n, 0.0) for n in names) for family, names in FAMILIES.items()}
    return {"num_layers": num_layers, "steps": steps, "per_layer_step": per_layer, "per_step": per_step,
            "families": families, "crossing": crossing(counts, steps)}  # fmt: skip


def crossing(counts: Counter[str], steps: int) -> dict[str, float]:
    """What one step crosses: pagedkv calls, distinct files (modules) and folders (packages) entered, and
    calls into the tier layer (`manager.tiering`, `manager.tier_link`, `offload`), per step."""
    modules = {name.split(":")[0] for name in counts}
    files = [getattr(sys.modules.get(m), "__file__", None) or m for m in modules]
    folders = {os.path.dirname(f) for f in files}
    tier = ("pagedkv.manager.tiering", "pagedkv.manager.tier_link", "pagedkv.offload")
    tier_calls = sum(n for name, n in counts.items() if name.split(":")[0].startswith(tier))
    return {"calls": sum(counts.values()) / steps, "files": len(modules), "folders": len(folders),
            "tier_calls": tier_calls / steps}  # fmt: skip


def format_step_calls(result: dict[str, Any]) -> str:
    """The families table, then every function, most called first (calls per layer per decode step)."""
    c = result["crossing"]
    lines = [f"one decode step: {c['calls']:.0f} pagedkv calls into {c['files']} files in {c['folders']} folders; "
             f"{c['tier_calls']:.0f} calls into the tier layer", ""]  # fmt: skip
    lines += [f"pagedkv calls per layer per decode step ({result['num_layers']} layers, {result['steps']} steps)", ""]
    lines += report.table(["family", "calls / layer / step"], [(f, f"{n:.3f}") for f, n in result["families"].items()])
    rows = sorted(result["per_layer_step"].items(), key=lambda kv: (-kv[1], kv[0]))
    lines += ["", *report.table(["function", "calls / layer / step"], [(name, f"{n:.3f}") for name, n in rows])]
    return "\n".join(lines)


def plots(result: dict[str, Any]) -> list[report.Plot]:
    """Calls per layer per step of each family (attention options, validation, positions, copies)."""
    families = list(result["families"])
    return [report.Plot("step_calls", "pagedkv calls per layer per decode step", "calls", families,
                        {f"{result['num_layers']} layers": [result["families"][f] for f in families]})]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks.step_calls`."""
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny Llama")
    p.add_argument("--batch", type=int, default=3, help="requests decoding together")
    p.add_argument("--steps", type=int, default=4, help="decode steps profiled")


def command(args: argparse.Namespace) -> int:
    """`python -m benchmarks.step_calls`: profile decode steps, print the tables, write --json / --plots."""
    result = count_step_calls(num_layers=args.layers, batch=args.batch, steps=args.steps)
    report.finish(args, format_step_calls(result), result, plots)
    return 0


if __name__ == "__main__":  # python -m benchmarks.step_calls
    from benchmarks.command import main

    sys.exit(main("benchmarks.step_calls", sys.modules[__name__]))
