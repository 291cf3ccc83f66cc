"""Config attributes a model does not use never give a wrong token (`pagedkv.hf.support.check_model`).

Real checkpoints carry attributes their model never reads (a ``num_key_value_heads`` on GPT-2, a
``sliding_window`` on OPT). Every architecture of docs/MODELS.md is built here with the attributes of
`architectures.STRAY` that its config does not set itself, in two groups:
- ``num_key_value_heads`` and ``head_dim``: the pages follow the attention modules, and the engine equals
  transformers' own `generate()` (fp32 logits within 1e-4; recurrent-state models: their full forward,
  within 1e-3, as in `test_state_models.py`), greedy tokens equal;
- ``sliding_window`` and ``layer_types`` (every layer sliding): transformers' own cache keeps the window the
  config names whatever the model's attention does, so where the two differ `from_hf` refuses with a
  ValueError naming both and leaves the model untouched; where they agree the engine equals `generate()`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from architectures import PARITY, STRAY, STRAY_BREAKS_TRANSFORMERS, STRAY_REFUSED
from architectures import build as build_parity
from architectures import config_for as parity_config
from state_models import STATE_MODELS, build_state_model
from state_models import config_for as state_config
from test_encoder_decoder import START as BART_START
from test_encoder_decoder import build as build_bart
from test_mla import build as build_mla
from test_mla import config_for as mla_config

import hf_models
from pagedkv.engine import EncoderDecoderEngine, LLMEngine

NEW_TOKENS = 4
BREAKS_TRANSFORMERS = STRAY_BREAKS_TRANSFORMERS  # left out: `test_left_out_strays_break_transformers`
REFUSED = STRAY_REFUSED

Family = tuple[Callable[[dict[str, Any]], Any], Callable[[dict[str, Any]], Any], float]


def _families() -> dict[str, Family]:
    """name -> (config of the test with these extra keywords, model of the test with them, tolerance)."""
    out: dict[str, Family] = {}
    for name, own in PARITY.items():
        out[name] = (lambda kw, n=name, o=own: parity_config(n, {**o, **kw}),
                     lambda kw, n=name, o=own: build_parity(n, {**o, **kw}), 1e-4)  # fmt: skip
    for name in hf_models.ARCHS:
        out[name] = (lambda kw, n=name: hf_models.config_for(n, kw),
                     lambda kw, n=name: hf_models.build(n, overrides=kw), 1e-4)  # fmt: skip
    for name in ("deepseek_v2", "deepseek_v3"):
        out[name] = (lambda kw, n=name: mla_config(n, kw), lambda kw, n=name: build_mla(n, overrides=kw), 1e-4)
    for name in STATE_MODELS:
        out[name] = (lambda kw, n=name: state_config(n, kw),
                     lambda kw, n=name: build_state_model(n, overrides=kw), 1e-3)  # fmt: skip
    return out


FAMILIES = _families()


def _sets(config: Any, attr: str) -> bool:
    try:
        return getattr(config, attr, None) is not None
    except Exception:  # noqa: BLE001 (a heterogeneous config's per-layer attribute, Gemma 4's head_dim): it has one
        return True


SHAPES = ("num_key_value_heads", "head_dim")  # transformers' cache takes shapes from the tensors: generate() is right
WINDOWS = ("sliding_window", "layer_types")  # transformers' cache keeps the config's window, whatever the model does


def strays(name: str, config: Any, attrs: tuple[str, ...]) -> dict[str, Any]:
    """The attributes `attrs` of `STRAY` that `config` does not set itself (and transformers can run with)."""
    out: dict[str, Any] = {}
    for attr in attrs:
        if _sets(config, attr) or (name, attr) in BREAKS_TRANSFORMERS:
            continue
        out[attr] = ["sliding_attention"] * config.num_hidden_layers if attr == "layer_types" else STRAY[attr]
    return out


def reference(model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """float32 [N, V]: the logits of each generated position from one forward of prompt + output, no cache."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.inference_mode():
        logits = model(ids, use_cache=False).logits[0].float()  # [L, V]
    return logits[len(prompt) - 1 :]


def generated(model: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy `generate()` of `NEW_TOKENS`: its tokens and logits float32 [N, V]."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


# the architectures whose configs leave an attribute of each kind unset (Cohere 2, for one, sets all four)
SHAPE_STRAYS = {n: extra for n, (config_of, _, _) in FAMILIES.items() if (extra := strays(n, config_of({}), SHAPES))}
WINDOW_STRAYS = {n: extra for n, (config_of, _, _) in FAMILIES.items() if (extra := strays(n, config_of({}), WINDOWS))}


def _serve(model: Any, prompt: list[int]) -> Any:
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=32, max_num_batched_tokens=8, record_logits=True)
    request = engine.add_request(prompt, NEW_TOKENS)
    engine.run()  # a 13-token prompt in chunks of 8: the second chunk reads the first one's pages
    return request


PROMPT = torch.randint(3, 128, (13,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("name", list(SHAPE_STRAYS))
def test_stray_head_attributes_change_nothing(name: str) -> None:
    """Stray ``num_key_value_heads`` / ``head_dim``: the pages follow the modules, and the engine equals
    transformers' own `generate()` (attention models) or its full forward (recurrent-state models)."""
    _, build, tolerance = FAMILIES[name]
    extra = SHAPE_STRAYS[name]
    model = build(extra)
    ref = copy.deepcopy(model)
    request = _serve(model, PROMPT)
    _equals_transformers(name, ref, request, extra, tolerance)


@pytest.mark.parametrize("name", list(WINDOW_STRAYS))
def test_stray_window_attributes_are_refused_or_change_nothing(name: str) -> None:
    """Stray ``sliding_window`` / ``layer_types`` (every layer sliding): where the model's attention keeps
    another window than transformers' cache would, `from_hf` refuses with both windows named and the model
    untouched; where they agree (a model whose layers do slide by that window), the engine equals `generate()`."""
    _, build, tolerance = FAMILIES[name]
    extra = WINDOW_STRAYS[name]
    model = build(extra)
    ref = copy.deepcopy(model)
    if name in REFUSED:
        _refused(name, model, ref)
        return
    try:
        request = _serve(model, PROMPT)
    except ValueError as error:
        assert "the model and its config disagree" in str(error), error
        assert f"model_type='{model.config.model_type}' cannot run on pagedkv: layer " in str(error)
        _untouched(model, ref)
        return
    _equals_transformers(name, ref, request, extra, tolerance)


def _equals_transformers(name: str, ref: Any, request: Any, extra: dict[str, Any], tolerance: float) -> None:
    """The engine's request equals transformers' own `generate()` on `ref` (attention models) or its full
    forward over the prompt and the engine's output (recurrent-state models): logits within `tolerance`,
    the same tokens."""
    if name in STATE_MODELS:
        expected = reference(ref, PROMPT, request.output)  # [N, V]
        tokens = expected.argmax(-1).tolist()
    else:
        tokens, expected = generated(ref, PROMPT)
    worst = float((torch.stack(request.logits) - expected).abs().max())
    assert worst < tolerance, f"{name} with {sorted(extra)}: logits differ by {worst}"
    assert request.output == tokens, name


def _untouched(model: Any, ref: Any) -> None:
    assert model.config._attn_implementation == ref.config._attn_implementation
    torch.testing.assert_close(reference(model, PROMPT, [5]), reference(ref, PROMPT, [5]), rtol=0, atol=0)


def _refused(name: str, model: Any, ref: Any) -> None:
    with pytest.raises(ValueError, match=f"model_type='{model.config.model_type}' cannot run on pagedkv: .*"
                                         f"{REFUSED[name]}"):  # fmt: skip
        LLMEngine.from_hf(model, page_size=4, num_pages=32)
    _untouched(model, ref)


def test_a_stray_sliding_window_is_refused_naming_both_windows() -> None:
    """GPT-2 never reads ``sliding_window``, but transformers' cache would keep only that many keys."""
    model = build_parity("gpt2", {"sliding_window": 3})
    with pytest.raises(ValueError, match=r"layer 0's attention keeps every earlier key, but the config "
                                         r"\(layer_types=None, sliding_window=3\) gives it a sliding window of 3 "
                                         r"keys.*set config.sliding_window"):  # fmt: skip
        LLMEngine.from_hf(model, page_size=4, num_pages=32)
    model.config.sliding_window = None  # what the error says to do
    ref = copy.deepcopy(model)
    request = _serve(model, PROMPT)
    tokens, expected = generated(ref, PROMPT)
    assert float((torch.stack(request.logits) - expected).abs().max()) < 1e-4
    assert request.output == tokens


def _bart(extra: dict[str, Any]) -> tuple[Any, Any, list[int]]:
    """BART with `extra`, its copy for transformers and the encoder prompt."""
    model = build_bart(overrides=extra)
    return model, copy.deepcopy(model), list(range(3, 20))


def test_bart_ignores_stray_head_attributes() -> None:
    """BART (`EncoderDecoderEngine`): its pages follow the attention modules; equal to transformers' generate()."""
    model, ref, encoder = _bart({"num_key_value_heads": 1, "head_dim": 8})
    engine = EncoderDecoderEngine.from_hf(model, page_size=4, num_pages=32, record_logits=True)
    request = engine.add_request(encoder, NEW_TOKENS)
    engine.run()
    with torch.inference_mode():
        out = ref.generate(torch.tensor([encoder]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, decoder_start_token_id=BART_START)  # fmt: skip
    assert float((torch.stack(request.logits) - torch.cat(out.logits)).abs().max()) < 1e-4
    assert request.output == out.sequences[0, 1:].tolist()


@pytest.mark.parametrize("extra", [{"sliding_window": 4}, {"layer_types": ["sliding_attention"] * 2}])
def test_bart_refuses_a_stray_window(extra: dict[str, Any]) -> None:
    """BART's decoder attends to every earlier token, while transformers' cache would keep the config's window."""
    model, ref, encoder = _bart(extra)
    with pytest.raises(ValueError, match="layer 0's attention keeps every earlier key, but the config"):
        EncoderDecoderEngine.from_hf(model, page_size=4, num_pages=32)
    decoder = torch.tensor([[BART_START, 5, 6]])
    with torch.inference_mode():
        got = model(input_ids=torch.tensor([encoder]), decoder_input_ids=decoder, use_cache=False).logits
        expected = ref(input_ids=torch.tensor([encoder]), decoder_input_ids=decoder, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # untouched


@pytest.mark.parametrize("name,attr", sorted(BREAKS_TRANSFORMERS))
def test_left_out_strays_break_transformers(name: str, attr: str) -> None:
    """The strays left out above are read by the model itself, which then cannot run: nothing to match."""
    config_of, build, _ = FAMILIES[name]
    with pytest.raises(RuntimeError):
        reference(build({attr: STRAY[attr]}), list(range(3, 16)), [5])


def test_every_attribute_is_tried() -> None:
    """Each attribute of `STRAY` is stray on most architectures (not set by their configs)."""
    counts = dict.fromkeys(STRAY, 0)
    for extra in [*SHAPE_STRAYS.values(), *WINDOW_STRAYS.values()]:
        for attr in extra:
            counts[attr] += 1
    assert all(n >= 10 for n in counts.values()), counts
