"""Triton paged decode (`pagedkv.ops.triton_decode`) against the reference.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors. The
flag is read when triton *defines* a kernel, so it must not be set in the
pytest process (every later kernel definition would be interpreted, and ours
would stay interpreted for the session): one child process (this file, run as
a script with the flag in its environment) checks every case, importing torch
and triton once, and prints one JSON line per case. With CUDA, the same cases
also run compiled in-process; without one, `test_kernels_compile_for_cuda`
still compiles the kernels for sm_80 and sm_90 (what the interpreter never
checks). Lookup tables come from a real `PagedKVCacheManager`; the pages hold
random K/V (FP8: quantized with `quantize_reference`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

if __name__ == "__main__":  # the interpreter child: tests/ holds helpers
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import ctx  # noqa: E402
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.ops import PagedMetadata, paged_attention, reference, triton_decode, use_backend
from pagedkv.ops.fp8 import quantize_reference
from pagedkv.params import KVCacheParams, KVCacheQuantizationConfig
from pagedkv.runtime.buffers import KVCacheBuffer
from pagedkv.runtime.inputs import RaggedKVCacheInputs, max_lengths_table

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")


@dataclass(frozen=True)
class Case:
    """One decode batch: every request decodes the token at position ``len(prompt)``."""

    dtype: str  # cache dtype (torch attribute name)
    query_dtype: str
    page_size: int
    n_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    prompts: tuple[int, ...]  # prompt length per request
    softcap: float | None = None
    num_splits: int | None = None  # None: the kernel's heuristic (1 on CPU)
    granularity: int | None = None  # FP8: head_dim elements per scale
    scale_dtype: str = "float32"
    mla: bool = False
    fp8_bits: bool = False  # decode FP8 bytes in the kernel, as on GPUs without native e4m3 (pre-sm_89)


CASES = {
    "f32-page1-mha": Case("float32", "float32", 1, 2, 1, 32, (0, 3, 9)),
    "f32-page3-gqa4-softcap-split3": Case("float32", "float32", 3, 2, 4, 64, (0, 40, 150), 5.0, 3),
    "f32-page16-gqa4-d128": Case("float32", "float32", 16, 1, 4, 128, (15, 16, 140)),
    "f32-page3-d48-masked": Case("float32", "float32", 3, 2, 2, 48, (7, 66), num_splits=2),
    "bf16-page16-gqa4-softcap-split2": Case("bfloat16", "bfloat16", 16, 2, 4, 64, (1, 31, 130), 30.0, 2),
    "bf16-page3-mha": Case("bfloat16", "bfloat16", 3, 2, 1, 32, (0, 17, 70)),
    "fp8-bf16q-page16-gqa4-1group": Case("float8_e4m3fn", "bfloat16", 16, 2, 4, 64, (4, 90), granularity=64),
    "fp8-f32q-page3-mha-2groups-softcap-split3": Case(
        "float8_e4m3fn", "float32", 3, 2, 1, 32, (0, 33, 100), 10.0, 3, granularity=16
    ),
    "fp8-bf16q-page16-gqa4-16groups": Case("float8_e4m3fn", "bfloat16", 16, 1, 4, 64, (20, 77), granularity=4),
    "fp8-e8m0-scales-page16-gqa4": Case(
        "float8_e4m3fn", "float32", 16, 1, 4, 32, (5, 60), granularity=16, scale_dtype="float8_e8m0fnu"
    ),
    "mla-f32-page16-16heads": Case("float32", "float32", 16, 1, 16, 64, (3, 50), 20.0, 2, mla=True),
    "fp8-bits-bf16q-page16-gqa4-2groups": Case(
        "float8_e4m3fn", "bfloat16", 16, 2, 4, 64, (9, 70), 30.0, 2, granularity=32, fp8_bits=True
    ),
    "fp8-e4m3fnuz-bits-f32q-page3": Case(
        "float8_e4m3fnuz", "float32", 3, 1, 2, 32, (0, 40), granularity=32, fp8_bits=True
    ),
    "fp8-e5m2-bits-unscaled-f32q": Case("float8_e5m2", "float32", 16, 1, 4, 32, (12, 50), fp8_bits=True),
}
FP8_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")  # the ones the kernel can decode from bits


def tolerance(case: Case) -> dict[str, float]:
    """float32 math throughout, so float32 outputs agree closely; bfloat16 ones to about one ulp."""
    if case.query_dtype == "float32":
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 2e-3, "rtol": 1.6e-2}


def decode_batch(case: Case, device: str, seed: int = 0) -> tuple[RaggedKVCacheInputs, torch.Tensor, torch.Tensor]:
    """(inputs, query [B, H_q, D], input_row_offsets [B + 1]) of one decode step, on `device`."""
    gen = torch.Generator().manual_seed(seed)
    quant = None
    if case.granularity is not None:
        quant = KVCacheQuantizationConfig(DType[case.scale_dtype], case.granularity)
    params = KVCacheParams(
        dtype=DType[case.dtype], n_kv_heads=case.n_kv_heads, head_dim=case.head_dim, num_layers=2,
        devices=[DeviceRef.CPU()], page_size=case.page_size, is_mla=case.mla,
        num_q_heads=case.n_kv_heads * case.group, kvcache_quant_config=quant,
    )  # fmt: skip
    pages = sum(-(-(n + 1) // case.page_size) + 1 for n in case.prompts)  # + 1: a filler page each
    mgr = PagedKVCacheManager(params, None, pages, max_batch_size=len(case.prompts), enable_runtime_checks=True)
    contexts, prefilled = [], []
    for i, n in enumerate(case.prompts):  # each request after a filler page freed below: scattered page ids
        filler = ctx(f"filler{i}", range(case.page_size))
        c = ctx(i, torch.randint(0, 1000, (n,), generator=gen).tolist() if n else [7])
        for each in (filler, c):
            mgr.claim(each.request_id)
            mgr.alloc(each)
        contexts.append(c)
        if n:
            prefilled.append(c)
    for c in prefilled:  # their prompts ran: now each decodes the token it produced (at position n)
        c.update(11)
    mgr.step([prefilled])
    for c in prefilled:
        mgr.alloc(c)
    for i in range(len(case.prompts)):
        mgr.release(f"filler{i}")
    inputs = mgr.runtime_inputs([contexts]).inputs[0]
    assert isinstance(inputs, RaggedKVCacheInputs)
    assert inputs.cache_lengths.tolist() == list(case.prompts)
    assert inputs.max_lengths.tolist() == [[1, max(case.prompts) + 1]]  # (longest window, longest kv length)

    buf = mgr.get_device_buffer()
    assert isinstance(buf, KVCacheBuffer)
    values = torch.randn(buf.values[0].shape, generator=gen)  # [P + 1, kv_dim, L, page, H_kv, D]
    if quant is None:
        buf.values[0].copy_(values)
    else:
        assert buf.scales is not None
        groups = case.head_dim // case.granularity
        q, s = quantize_reference(values.reshape(-1, case.head_dim), groups, buf.values[0].dtype, buf.scales[0].dtype)
        buf.values[0].copy_(q.reshape(values.shape))
        buf.scales[0].copy_(s.reshape(buf.scales[0].shape))
    scales = None if inputs.kv_scales is None else inputs.kv_scales.to(device)
    inputs = RaggedKVCacheInputs(
        inputs.blocks.to(device), inputs.cache_lengths.to(device), inputs.lookup_table.to(device),
        inputs.max_lengths, scales,
    )  # fmt: skip
    batch = len(case.prompts)
    query = torch.randn((batch, case.n_kv_heads * case.group, case.head_dim), generator=gen)  # [B, H_q, D]
    offsets = torch.arange(batch + 1, device=device)  # [B + 1]: one token each
    return inputs, query.to(getattr(torch, case.query_dtype)).to(device), offsets


def reference_output(
    inputs: RaggedKVCacheInputs, query: torch.Tensor, offsets: torch.Tensor, softcap: float | None
) -> torch.Tensor:
    """`paged_attention_reference` of layer 1, on CPU copies."""
    scales = None if inputs.kv_scales is None else inputs.kv_scales.cpu()
    return reference.paged_attention_reference(
        query.cpu(), inputs.blocks.cpu(), inputs.lookup_table.cpu(), inputs.cache_lengths.cpu(), offsets.cpu(), 1,
        None, softcap, scales,
    )  # fmt: skip


def fp8_from_bits(on: bool) -> Any:
    """Context: make the kernel decode FP8 bytes itself (as below sm_89) when `on`; else leave the choice to it."""
    if not on:
        return nullcontext()
    return mock.patch.object(triton_decode, "_native_fp8", lambda dtype, device: dtype not in triton_decode._FP8_BITS)


def check_case(case: Case, device: str) -> dict[str, float]:
    """Run one case through the dispatcher (backend "triton", or the kernel itself to force splits or FP8
    decoding) and the reference; raise on mismatch."""
    inputs, query, offsets = decode_batch(case, device)
    if case.num_splits is None and not case.fp8_bits:
        with use_backend("triton"):
            got = paged_attention(query, inputs, offsets, 1, softcap=case.softcap)  # [B, H_q, D]
    else:
        meta = PagedMetadata.build(inputs, offsets, query.shape[0])
        with fp8_from_bits(case.fp8_bits):
            got = triton_decode.paged_decode(
                query, inputs.blocks, meta, 1, None, case.softcap, inputs.kv_scales, num_splits=case.num_splits
            )  # [B, H_q, D]
    expected = reference_output(inputs, query, offsets, case.softcap)  # [B, H_q, D]
    assert got.dtype == query.dtype and got.shape == query.shape
    torch.testing.assert_close(got.cpu().float(), expected.float(), **tolerance(case))
    return {"max_abs_err": float((got.cpu().float() - expected.float()).abs().max())}


def check_fp8_bytes(dtype_name: str, device: str, bits: bool) -> dict[str, float]:
    """Every finite byte of an FP8 dtype, decoded by the kernel: a one-position decode returns V exactly."""
    dtype = getattr(torch, dtype_name)
    raw = torch.arange(256, dtype=torch.uint8)  # [256]
    raw = torch.where(torch.isfinite(raw.view(dtype).float()), raw, 0)  # NaN/inf bytes -> 0
    blocks = torch.zeros((2, 2, 1, 1, 1, 256), dtype=torch.uint8)  # [P + 1, kv_dim, L, page, H_kv, D = 256]
    blocks[0, 1, 0, 0, 0] = raw  # V of position 0
    inputs = RaggedKVCacheInputs(
        blocks.view(dtype).to(device), torch.zeros(1, dtype=torch.int32, device=device),
        torch.zeros((1, 1), dtype=torch.int32, device=device), max_lengths_table(1, 1),
    )  # fmt: skip
    meta = PagedMetadata.build(inputs, torch.arange(2, device=device), 1)
    query = torch.zeros((1, 1, 256), device=device)  # [B, H_q, D]
    with fp8_from_bits(bits):
        got = triton_decode.paged_decode(query, inputs.blocks, meta, 0)  # [1, 1, 256]
    torch.testing.assert_close(got[0, 0].cpu(), raw.view(dtype).float(), atol=0, rtol=0)
    return {"max_abs_err": 0.0}


def check_short_max_kv_len(device: str) -> dict[str, float]:
    """A host max_kv_len below the real lengths costs speed, not positions: the last split takes the rest."""
    case = CASES["f32-page3-gqa4-softcap-split3"]
    inputs, query, offsets = decode_batch(case, device)
    short = RaggedKVCacheInputs(inputs.blocks, inputs.cache_lengths, inputs.lookup_table, max_lengths_table(1, 20))
    meta = PagedMetadata.build(short, offsets, query.shape[0])
    expected = reference_output(inputs, query, offsets, case.softcap)  # [B, H_q, D]
    for splits in (None, 3):
        got = triton_decode.paged_decode(query, inputs.blocks, meta, 1, None, case.softcap, num_splits=splits)
        torch.testing.assert_close(got.cpu(), expected, **tolerance(case))
    return {"max_abs_err": float((got.cpu() - expected).abs().max())}


def check_bench_batch(dtype: str, device: str) -> dict[str, float]:
    """The kernel on a small `bench_batch`, against the bench's own dense check (same tolerance)."""
    from pagedkv.bench.triton_bench import bench_batch, dense_decode

    query, inputs, meta = bench_batch(3, 100, 2, 8, 64, 16, dtype, 32, torch.device(device))
    got = triton_decode.paged_decode(query, inputs.blocks, meta, 0, None, None, inputs.kv_scales)  # [B, H_q, D]
    expected = dense_decode(query, inputs.blocks, inputs.kv_scales, inputs.lookup_table, 100)  # [B, H_q, D]
    torch.testing.assert_close(got.float(), expected, atol=2e-3, rtol=1.6e-2)
    return {"max_abs_err": float((got.float() - expected).abs().max())}


CHECKS: dict[str, Callable[[str], dict[str, float]]] = {
    "short-max-kv-len": check_short_max_kv_len,
    "bench-batch-bf16": functools.partial(check_bench_batch, "bfloat16"),
    "bench-batch-fp8": functools.partial(check_bench_batch, "float8_e4m3fn"),
    **{name: functools.partial(check_case, case) for name, case in CASES.items()},
    **{f"bytes-{d}-{mode}": functools.partial(check_fp8_bytes, d, bits=mode == "bits") for d in FP8_DTYPES
       for mode in ("bits", "auto")},
}  # fmt: skip


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, object]]:
    """Every case under TRITON_INTERPRET=1 in one child process: name -> result or error."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600, check=False
    )  # fmt: skip
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row.pop("case")] = row
    assert results, f"the interpreter child printed no results (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return results


@needs_triton
@pytest.mark.parametrize("name", list(CHECKS))
def test_interpreted_kernel_matches_reference(interpreted: dict[str, dict[str, object]], name: str) -> None:
    result = interpreted.get(name, {"error": "case did not run (the child died before it)"})
    assert "error" not in result, f"{name}: {result['error']}"


@needs_triton
def test_interpreter_flag_does_not_leak() -> None:
    assert os.environ.get("TRITON_INTERPRET") in (None, "", "0")
    kernels = sys.modules.get("pagedkv.ops._triton_decode_kernels")
    assert kernels is None or not kernels.INTERPRETED


@needs_cuda
@pytest.mark.parametrize("name", list(CHECKS))
def test_compiled_kernel_matches_reference(name: str) -> None:
    CHECKS[name]("cuda")


@needs_cuda
def test_available_on_cuda() -> None:
    assert triton_decode.available()


COMPILE_CASES = {  # compiled for sm_80 (FP8 decoded from bits) and sm_90 (native FP8) without a GPU
    "bf16-gqa4-d128-split": Case("bfloat16", "bfloat16", 16, 2, 4, 128, (100,), num_splits=2),
    "fp8-2groups-bf16q": Case("float8_e4m3fn", "bfloat16", 16, 2, 4, 128, (100,), 30.0, granularity=64),
}


def compile_for_cuda(launch: triton_decode._Launch, arch: int) -> Any:
    """`triton.compile` one planned launch for sm_`arch`, specialised as triton's launcher would (no GPU needed)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(triton_decode._kernels(), launch.kernel)
    constexprs = dict(launch.constexprs)
    options = {name: constexprs.pop(name) for name in ("num_warps", "num_stages") if name in constexprs}
    signature = {name: "constexpr" for name in constexprs}
    attrs = {}
    for i, (name, arg) in enumerate(zip(kernel.arg_names, launch.args, strict=False)):
        kind, key = native_specialize_impl(BaseBackend, arg, False, True, True)  # e.g. ("*bf16", "D"), ("constexpr", 1)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = key
        elif key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


@needs_triton
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_kernels_compile_for_cuda(name: str, arch: int) -> None:
    """ptxas accepts the kernels (the interpreter checks numerics, not what the compiler rejects)."""
    case = COMPILE_CASES[name]
    inputs, query, offsets = decode_batch(case, "cpu")
    meta = PagedMetadata.build(inputs, offsets, query.shape[0])
    with fp8_from_bits(arch < 89):  # e4m3fn needs sm_89+
        launches = triton_decode._launches(
            query, inputs.blocks, meta, 1, None, case.softcap, inputs.kv_scales, case.num_splits, torch.empty_like(query)
        )  # fmt: skip
    for launch in launches:
        compiled = compile_for_cuda(launch, arch)
        assert compiled.metadata.shared <= 99 * 1024  # fits every GPU from sm_80 on


def test_import_needs_no_triton() -> None:
    code = "import sys, pagedkv.ops.triton_decode; assert 'triton' not in sys.modules, 'triton was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_not_available_without_cuda() -> None:
    assert triton_decode.available() is False


def test_auto_backend_never_picks_triton_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES["f32-page3-gqa4-softcap-split3"]
    inputs, query, offsets = decode_batch(case, "cpu")

    def fail(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the auto backend sent CPU tensors to the Triton kernel")

    monkeypatch.setattr(triton_decode, "available", lambda: True)  # even where triton looks usable
    monkeypatch.setattr(triton_decode, "paged_decode", fail)
    with use_backend("auto"):
        got = paged_attention(query, inputs, offsets, 1, softcap=case.softcap)  # [B, H_q, D]
    torch.testing.assert_close(got, reference_output(inputs, query, offsets, case.softcap))


def test_rejects_batches_that_are_not_decode_only() -> None:
    case = CASES["f32-page3-gqa4-softcap-split3"]
    inputs, query, _ = decode_batch(case, "cpu")
    two_tokens = torch.tensor([0, 1, 2, 4])  # [B + 1]: the last request has 2 tokens
    prefill = RaggedKVCacheInputs(inputs.blocks, inputs.cache_lengths, inputs.lookup_table, max_lengths_table(2, 150))
    meta = PagedMetadata.build(prefill, two_tokens, 4)
    with pytest.raises(ValueError, match="decode batches"):
        triton_decode.paged_decode(torch.cat([query, query[:1]]), inputs.blocks, meta, 1)
    with pytest.raises(ValueError, match="layer=2 must be in"):
        triton_decode.paged_decode(query, inputs.blocks, PagedMetadata.build(inputs, torch.arange(4), 3), 2)
    with use_backend("triton"), pytest.raises(ValueError, match="layer=2 must be in"):  # checked at the entry point
        paged_attention(query, inputs, torch.arange(4), 2)


@pytest.mark.parametrize(
    ("batch", "heads", "group", "head_dim", "max_kv_len", "sms"),
    [(32, 8, 4, 128, 2048, 132), (1, 1, 1, 64, 1, 132), (3, 2, 128, 576, 5000, 108), (256, 8, 8, 128, 100, 132)],
)
def test_decode_config_covers_the_context(
    batch: int, heads: int, group: int, head_dim: int, max_kv_len: int, sms: int
) -> None:
    cfg = triton_decode.decode_config(batch, heads, group, head_dim, max_kv_len, sms, None)
    assert cfg.block_d >= max(16, head_dim) and cfg.block_d & (cfg.block_d - 1) == 0
    assert cfg.block_h >= 16 and cfg.head_blocks * cfg.block_h >= group
    assert cfg.split_len % cfg.block_n == 0 and 1 <= cfg.num_splits <= 64
    assert (cfg.num_splits - 1) * cfg.split_len < max_kv_len <= cfg.num_splits * cfg.split_len  # no empty split
    assert triton_decode.decode_config(batch, heads, group, head_dim, max_kv_len, sms, 1).num_splits == 1


def _run_child() -> None:
    """Child entry point: check every case (under TRITON_INTERPRET=1), one JSON line each."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    for name, check in CHECKS.items():
        try:
            row: dict[str, object] = {"case": name, **check("cpu")}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the case
            row = {"case": name, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _run_child()
