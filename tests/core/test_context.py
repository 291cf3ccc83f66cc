"""TokenBuffer and TextContext: the processing window and its errors."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import ctx
from pagedkv.core.context import TextContext, TokenBuffer


def window(tb: TokenBuffer) -> tuple[int, int, int]:
    return tb.processed_length, tb.active_length, len(tb)


def test_prefill_then_decode() -> None:
    c = ctx("r", range(5))
    assert window(c.tokens) == (0, 5, 5) and c.tokens.active.tolist() == [0, 1, 2, 3, 4]
    c.update(42)
    assert window(c.tokens) == (5, 1, 6) and c.tokens.active.tolist() == [42]
    assert (c.tokens.prompt_length, c.tokens.generated_length, c.tokens.current_position) == (5, 1, 6)
    assert c.tokens.all.dtype == np.int32 and c.tokens[-1] == 42


def test_chunked_prefill_discards_mid_prompt_token() -> None:
    c = ctx("r", range(10))
    c.tokens.chunk(4)
    assert window(c.tokens) == (0, 4, 10) and c.tokens.is_chunked
    c.update(99)  # sampled from a partial prompt: ignored
    assert window(c.tokens) == (4, 6, 10) and not c.tokens.is_chunked
    c.update(7)
    assert window(c.tokens) == (10, 1, 11) and c.tokens[10] == 7


def test_skip_and_rewind() -> None:
    tb = TokenBuffer(list(range(8)))
    tb.skip_processing(5)
    assert window(tb) == (5, 3, 8)
    with pytest.raises(ValueError, match=r"skip_processing\(n=3\) needs 0 <= n < active_length=3"):
        tb.skip_processing(3)
    tb.rewind_processing(2)
    assert window(tb) == (3, 5, 8)
    with pytest.raises(ValueError, match=r"rewind_processing\(n=4\) needs 0 <= n <= processed_length=3"):
        tb.rewind_processing(4)


def test_growth_keeps_tokens() -> None:
    c = ctx("r", [1])
    for t in range(100):
        c.update(t)
    assert c.tokens.all.tolist() == [1, *range(100)]


def test_reset_makes_everything_prompt() -> None:
    c = ctx("r", range(4))
    c.update(9)
    c.cached_prefix_length = 3
    c.reset()
    assert window(c.tokens) == (0, 5, 5) and c.tokens.prompt_length == 5 and c.cached_prefix_length == 0


def test_max_length() -> None:
    c = ctx("r", range(3), max_length=4)
    c.update(1)
    assert c.is_done
    with pytest.raises(ValueError, match="reached max_length=4"):
        c.update(2)
    with pytest.raises(ValueError, match="max_length=2 must be an int >= the prompt length 3"):
        ctx("r", range(3), max_length=2)


@pytest.mark.parametrize(
    "tokens,error,message",
    [
        ([], ValueError, "non-empty 1-D"),
        ([[1, 2]], ValueError, "non-empty 1-D"),
        ([1.5, 2.0], TypeError, "tokens must be integers"),
        ([1, 2**31], ValueError, "token 2147483648 is outside int32"),
        ([-(2**31) - 1], ValueError, "outside int32"),
        ([5, True, 7], TypeError, r"tokens\[1\]=True is not a token id"),  # (numpy alone makes it token 1)
        ([5, 6, np.False_], TypeError, r"tokens\[2\]=np.False_ is not a token id"),
        ([True, False], TypeError, "tokens must be integers, got dtype bool"),
        (np.array([5, True], dtype=object), TypeError, r"tokens\[1\]=True is not a token id"),
        (np.array([5, 2.5], dtype=object), TypeError, r"tokens\[1\]=2.5 is not a token id"),
        (np.array([5, 2**40], dtype=object), ValueError, "token 1099511627776 is outside int32"),
        (np.array([5, "7"], dtype=object), TypeError, r"tokens\[1\]='7' is not a token id"),
    ],
)
def test_bad_tokens(tokens: list, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        TextContext("r", tokens)


def test_object_arrays_of_ints_are_token_ids() -> None:
    """An object array of Python or numpy ints (what pandas and JSON decoders hand over) is read as its
    values: never a StopIteration from the int32 check."""
    for tokens in (np.array([5, 6, 7], dtype=object), np.array([5, np.int64(6), 2**31 - 1], dtype=object)):
        c = TextContext("r", tokens)
        assert c.tokens.all.dtype == np.int32 and c.tokens.all.tolist() == [int(t) for t in tokens]


def test_empty_salt_is_refused() -> None:
    """None is "no salt"; every non-empty str is a tenant; "" is neither (it would share the unsalted chain)."""
    with pytest.raises(ValueError, match="cache_salt='' is empty: give None for no salt"):
        TextContext("r", [1, 2], cache_salt="")


def test_bad_updates_change_nothing() -> None:
    c = ctx("r", range(3))
    for bad, error in ((2**31, ValueError), ("7", TypeError), (True, TypeError)):
        with pytest.raises(error):
            c.update(bad)  # type: ignore[arg-type]
        assert window(c.tokens) == (0, 3, 3)
    c.tokens.chunk(1)
    with pytest.raises(ValueError, match="advance_with_token while chunked"):
        c.tokens.advance_with_token(1)
    with pytest.raises(ValueError, match=r"chunk\(n=0\)"):
        c.tokens.chunk(0)
    with pytest.raises(TypeError, match="cache_salt=5 must be a str"):
        TextContext("r", [1], cache_salt=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TextContext(["unhashable"], [1])  # type: ignore[arg-type]


def test_views_are_read_only() -> None:
    c = ctx("r", range(3))
    with pytest.raises(ValueError):
        c.tokens.all[0] = 5
