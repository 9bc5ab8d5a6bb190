"""Input validation for every public function: each raises an error that names the argument, what
was expected and what came. (The exercise checkers, which grade a learner's code, are in `checks`.)

Call them as `validate.positive_int("n_heads", n_heads)`; each returns the value it accepted.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Collection, Iterable
from numbers import Integral, Real
from typing import Any, TypeVar

import regex
import torch
from torch import Tensor

T = TypeVar("T")


def named(name: Any, helper: str) -> str:
    """The argument's name, which every helper here takes first: `positive_int(3, "q_len")`,
    the arguments swapped, is refused here rather than read as an argument named 3."""
    if not isinstance(name, str):
        raise TypeError(
            f"validate.{helper}: expected the argument's name (a str) first, then its value, as "
            f'in validate.{helper}("q_len", q_len); got {name!r} where the name goes'
        )
    return name


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """An int (not a bool) in [low, high]; NumPy integers are accepted and returned as int."""
    named(name, "positive_int" if low == 1 and high is None else "integer")
    in_range = isinstance(value, Integral) and (low is None or value >= low)
    in_range = in_range and (high is None or value <= high)
    if isinstance(value, bool) or not in_range:
        if low == 1 and high is None:
            wanted = "a positive int"
        else:
            bounds = [
                f">= {low}" if low is not None else "",
                f"<= {high}" if high is not None else "",
            ]
            wanted = " and ".join(["an int", *(b for b in bounds if b)]).replace("int and", "int")
        raise ValueError(f"{name}: expected {wanted}, got {value!r}")
    return int(value)


def is_int(value: Any) -> bool:
    """An int (NumPy ints too) that is not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    """An int >= 1: a size, a length, a count of steps."""
    return integer(name, value, low=1)


def number(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    finite: bool = True,
) -> float:
    """A real number (not a bool) in [low, high], or (low, high] with `low_open`: finite, or
    also +inf with `finite=False` (never NaN)."""
    ok = isinstance(value, Real) and not isinstance(value, bool)
    ok = ok and (math.isfinite(value) or (not finite and value == math.inf))
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bounds = []
        if low > -math.inf:
            bounds.append(f"{'>' if low_open else '>='} {low:g}")
        if high < math.inf:
            bounds.append(f"<= {high:g}")
        kind = "a finite number" if finite else "a number (inf allowed)"
        wanted = " ".join([kind, " and ".join(bounds)]).strip()
        raise ValueError(f"{name}: expected {wanted}, got {value!r}")
    return float(value)


def tensors(name: str, values: list) -> list[Tensor]:
    """A list of tensors (the parameters of a model, say)."""
    for index, value in enumerate(values):
        if not isinstance(value, Tensor):
            named = isinstance(value, tuple) and value  # from named_parameters(), say
            got = type(value).__name__ + (f" ({value[0]!r}, ...)" if named else "")
            raise TypeError(f"{name}[{index}]: expected a torch.Tensor, got {got}")
    return values


def probability(name: str, value: Any) -> float:
    """A dropout-style probability in [0, 1)."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and 0 <= value < 1
    if not ok:
        raise ValueError(f"{name}: expected a probability in [0, 1), got {value!r}")
    return float(value)


def flag(name: str, value: Any) -> bool:
    """True or False, nothing that merely converts to one."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return value


def one_of(name: str, value: T, choices: Collection[T]) -> T:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {sorted(choices)}, got {value!r}")
    return value


def text(name: str, value: Any, *, utf8: bool = False) -> str:
    """A str; with `utf8`, one that UTF-8 can encode (no lone surrogates such as '\\ud800')."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    if utf8:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{name}: expected a string UTF-8 can encode, got the lone surrogate "
                f"{value[exc.start]!r} at index {exc.start}"
            ) from None
    return value


def distinct_strings(name: str, values: Any) -> list[str]:
    """An iterable (not a single str) of distinct non-empty strings, returned as a list."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name}: expected an iterable of strings, not one str, got {values!r}")
    values = list(values)
    for value in values:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name}: expected non-empty strings, got {value!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}: expected distinct strings, got {values}")
    return values


def regex_pattern(name: str, value: Any) -> str | None:
    """None, or a regular expression in the `regex` module's syntax (which knows `\\p{L}`)."""
    if value is None:
        return None
    if not isinstance(value, str):
        got = type(value).__name__
        raise TypeError(f"{name}: expected a regular expression str or None, got {got}")
    try:
        regex.compile(value)
    except regex.error as exc:
        raise ValueError(
            f"{name}: expected a valid regular expression, got {value!r} ({exc})"
        ) from None
    return value


def token_ids(name: str, ids: Any, d_vocab: int) -> list[int]:
    """Ids in [0, d_vocab) as a list of int: Python, NumPy or 0-d tensor integers, not bools."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(ids).__name__}")
    checked = []
    for position, token in enumerate(ids):
        try:
            if isinstance(token, bool) or getattr(token, "dtype", None) == torch.bool:
                raise TypeError  # True is an int to Python, but never meant as token 1
            i = operator.index(token)
        except TypeError:
            i = -1
        if not 0 <= i < d_vocab:
            raise ValueError(
                f"{name}: expected token ids in the vocabulary (0..{d_vocab - 1}), "
                f"got {token!r} at position {position}"
            )
        checked.append(i)
    return checked


# Token tensors must be int64 or int32: W_E[tokens] reads uint8 and bool as masks, not ids, and
# refuses int8 and int16.
TOKEN_DTYPES = (torch.int64, torch.int32)


def token_tensor(
    name: str, t: Any, d_vocab: int, *, n_ctx: int | None = None, cached: int = 0
) -> Tensor:
    """A `(batch, pos)` tensor of ids in [0, d_vocab) with at least one position and, given
    `n_ctx`, at most `n_ctx` together with `cached` earlier ones (a KV cache's). Reading the ids'
    range costs one host-device synchronisation, which compiled code skips."""
    named(name, "token_tensor")
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of token ids, got {type(t).__name__}")
    if t.dtype not in TOKEN_DTYPES:
        raise TypeError(f"{name}: expected an integer tensor (int64 or int32), got {t.dtype}")
    if t.ndim != 2 or t.shape[1] == 0:
        raise ValueError(
            f"{name}: expected shape (batch, pos) with at least one position, got {tuple(t.shape)}"
        )
    if n_ctx is not None and cached + t.shape[1] > n_ctx:
        with_cached = f" with the {cached} cached ones" if cached else ""
        raise ValueError(
            f"{name}: expected at most n_ctx={n_ctx} positions{with_cached}, got "
            f"{cached + t.shape[1]} (shape {tuple(t.shape)}); "
            + ("start a new cache from the last tokens" if cached else "keep the last n_ctx tokens")
        )
    if t.numel() and not torch.compiler.is_compiling():
        low, high = torch.stack(torch.aminmax(t)).tolist()
        if low < 0 or high >= d_vocab:
            raise ValueError(
                f"{name}: expected ids in [0, d_vocab={d_vocab}), got ids from {low} to {high}"
            )
    return t


def kv_cache(cache: Any, tokens: Any, n_layers: int, n_heads: int, d_head: int) -> int:
    """A KV cache for `tokens`: None, or what the last call returned, a pair (keys, values) per
    block, all of one shape `(batch, n_heads, pos, d_head)` with the batch of `tokens`. Returns
    `pos`, the number of cached positions (0 for None)."""
    if cache is None:
        return 0
    batch = tokens.shape[0] if isinstance(tokens, Tensor) and tokens.ndim else None
    pairs = isinstance(cache, (list, tuple)) and len(cache) == n_layers
    pairs = pairs and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in cache)
    given = pairs and all(isinstance(t, Tensor) for pair in cache for t in pair)
    shapes = sorted({tuple(t.shape) for pair in cache for t in pair}) if given else []
    if (
        len(shapes) != 1
        or len(shapes[0]) != 4
        or shapes[0][1::2] != (n_heads, d_head)
        or (batch is not None and shapes[0][0] != batch)
    ):
        wanted = f"(batch={batch or 'batch'}, n_heads={n_heads}, pos, d_head={d_head})"
        got = f"shapes {shapes}" if given else f"{type(cache).__name__} {cache!r:.80}"
        raise ValueError(
            f"cache: expected None or, for each of the {n_layers} blocks, (keys, values) of one "
            f"shape {wanted}, as the last call returned; got {got}"
        )
    return shapes[0][2]


def token_id(name: str, value: Any, d_vocab: int) -> int:
    """An int id in [0, d_vocab)."""
    if not is_int(value) or not 0 <= value < d_vocab:
        raise ValueError(f"{name}: expected an int id in [0, {d_vocab}), got {value!r}")
    return int(value)


def bool_mask(name: str, mask: Any) -> Tensor:
    """A bool tensor, True = may attend (the convention of PyTorch's SDPA)."""
    named(name, "bool_mask")
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name}: expected a bool tensor (True = may attend), got {got}")
    return mask


def last_dim(name: str, x: Any, d_model: int, dtype: torch.dtype | None = None) -> Tensor:
    """A floating-point tensor whose last dimension is `d_model` and, given `dtype`, of that
    dtype (`weights_dtype`)."""
    named(name, "last_dim")
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[-1] != d_model:
        got = x.shape[-1] if x.ndim else "none (a 0-d tensor)"
        raise ValueError(
            f"{name}: expected last dim d_model={d_model}, got {got} (shape {tuple(x.shape)})"
        )
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if dtype is not None:
        weights_dtype(name, x, dtype)
    return x


def weights_dtype(name: str, t: Tensor, dtype: torch.dtype) -> None:
    """A layer's input `t` in its weights' `dtype` (autocast casts for itself)."""
    if t.dtype != dtype and not torch.is_autocast_enabled(t.device.type):
        raise ValueError(
            f"{name}: expected dtype {dtype} (the dtype of the weights), got {t.dtype}; "
            "convert the input or the module with .to(dtype)"
        )


def integer_tensor(name: str, t: Any, dims: tuple[str, ...]) -> Tensor:
    """An integer (not bool) tensor with one dimension per name in `dims`, e.g. token ids."""
    if not isinstance(t, Tensor) or t.ndim != len(dims):
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(
            f"{name}: expected an integer tensor of shape ({', '.join(dims)}), got {got}"
        )
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer dtype, got {t.dtype}")
    return t


def head_size(d_model: Any, n_heads: Any, d_head: Any = None) -> int:
    """Positive `d_model` and `n_heads`; returns `d_head`, by default `d_model // n_heads` (which
    must then divide evenly)."""
    positive_int("d_model", d_model)
    positive_int("n_heads", n_heads)
    if d_head is None:
        if d_model % n_heads:
            raise ValueError(
                f"d_model: expected a multiple of n_heads={n_heads} when d_head is not given, "
                f"got {d_model}"
            )
        d_head = d_model // n_heads
    return positive_int("d_head", d_head)


def even(name: str, value: Any, why: str = "") -> int:
    """An even int >= 2; `why` says why it must be even."""
    if not is_int(value) or value < 2 or value % 2:
        because = f" ({why})" if why else ""
        raise ValueError(f"{name}: expected an even int >= 2{because}, got {value!r}")
    return int(value)


def divisor(name: str, value: Any, of_name: str, of: int) -> int:
    """A positive int that divides another argument's value `of` (named `of_name`)."""
    if not is_int(value) or value < 1 or of % value:
        raise ValueError(f"{name}: expected a positive divisor of {of_name}={of}, got {value!r}")
    return int(value)


def rope_input(x: Any, d_head: int | None = None) -> Tensor:
    """Queries or keys `x` `(..., pos, d_head)` of a floating dtype with an even `d_head` (RoPE
    rotates pairs of dims) and, given `d_head`, that one."""
    if not isinstance(x, Tensor) or x.ndim < 2 or not x.is_floating_point():
        got = type(x).__name__
        if isinstance(x, Tensor):
            got = f"a {x.dtype} tensor of shape {tuple(x.shape)}"
        raise ValueError(f"x: expected a floating-point tensor (..., pos, d_head), got {got}")
    if d_head is not None and x.shape[-1] != d_head:
        raise ValueError(
            f"x: expected last dim d_head={d_head}, got {x.shape[-1]} (shape {tuple(x.shape)})"
        )
    even("d_head (the last dim of x)", x.shape[-1], "RoPE rotates pairs of dims")
    return x


def integer_positions(positions: Any) -> Tensor:
    """Positions `(..., pos)`: a tensor of an integer dtype (not bool) with at least one dim."""
    if not isinstance(positions, Tensor) or positions.ndim == 0 or positions.dtype == torch.bool:
        got = type(positions).__name__
        if isinstance(positions, Tensor):
            got = f"a {positions.dtype} tensor of shape {tuple(positions.shape)}"
        raise ValueError(f"positions: expected an integer tensor (..., pos), got {got}")
    if positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"positions: expected an integer dtype, got {positions.dtype}")
    return positions


def rope_positions(positions: Any, x: Tensor, n_ctx: int | None = None, offset: int = 0) -> Tensor:
    """Integer `positions` `(..., pos)` that broadcast to the leading dims `(..., pos)` of `x`
    and, given `n_ctx`, lie in [0, n_ctx) (rows of a table; reading them costs a host
    synchronisation, which compiled code skips). They say where each token is, so an `offset`
    as well would be ambiguous."""
    if offset != 0:
        raise ValueError(
            f"offset: expected 0 when positions are given (they include it), got {offset!r}"
        )
    integer_positions(positions)
    try:
        fits = torch.broadcast_shapes(positions.shape, x.shape[:-1]) == x.shape[:-1]
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"positions: expected a shape broadcastable to x's (..., pos) {tuple(x.shape[:-1])}, "
            f"got {tuple(positions.shape)}"
        )
    if n_ctx is not None and positions.numel() and not torch.compiler.is_compiling():
        low, high = torch.stack(torch.aminmax(positions)).tolist()
        if low < 0 or high >= n_ctx:
            raise ValueError(
                f"positions: expected positions in [0, n_ctx={n_ctx}), got {low} to {high}"
            )
    return positions


def attention_input(
    name: str, t: Any, d_model: int, dtype: torch.dtype, batch: int | None = None
) -> Tensor:
    """A `(batch, pos, d_model)` tensor of the weights' dtype (autocast casts for itself) and,
    given `batch`, of that batch size."""
    if not isinstance(t, Tensor) or t.ndim != 3 or t.shape[-1] != d_model or not t.shape[1]:
        got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        wanted = f"(batch, pos, d_model={d_model}) with pos >= 1"
        raise ValueError(f"{name}: expected shape {wanted}, got {got}")
    weights_dtype(name, t, dtype)
    if batch is not None and t.shape[0] != batch:
        raise ValueError(
            f"{name}: expected batch size {batch} (the batch size of x), got {t.shape[0]}"
        )
    return t


def attention_inputs(q: Any, k: Any, v: Any, mask: Any = None) -> None:
    """Queries `(..., q_pos, d_head)`, keys `(..., k_pos, d_head)` and values `(..., k_pos, d_v)`
    of one floating dtype whose batch dims broadcast, and a bool mask (or None) that broadcasts
    to the scores `(..., q_pos, k_pos)`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.ndim < 2 or not t.is_floating_point():
            got = type(t).__name__
            if isinstance(t, Tensor):
                got = f"{t.dtype} tensor of shape {tuple(t.shape)}"
            raise ValueError(
                f"{name}: expected a floating-point tensor of shape (..., pos, d), got {got}"
            )
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {t.dtype}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k: expected last dim d_head={q.shape[-1]} (the last dim of q), "
            f"got {k.shape[-1]} (shape {tuple(k.shape)})"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"v: expected k_pos={k.shape[-2]} positions (dim -2 of k), "
            f"got {v.shape[-2]} (shape {tuple(v.shape)})"
        )
    try:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            "k, v: batch dims must broadcast with q's; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        ) from None
    if mask is None:
        return
    bool_mask("mask", mask)
    scores_shape = (*batch, q.shape[-2], k.shape[-2])
    try:
        fits = torch.broadcast_shapes(mask.shape, scores_shape) == torch.Size(scores_shape)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask: expected a shape broadcastable to the scores' {scores_shape} "
            f"(..., q_pos, k_pos), got {tuple(mask.shape)}"
        )


def norm_args(d_model: Any, eps: Any) -> None:
    """A norm's constructor arguments: an int `d_model` >= 1, an `eps` > 0.

    With `eps=0` a constant vector has variance 0 and gives 0 / 0 = NaN, and so does an `eps` too
    small for float32 (the dtype half-precision inputs are computed in), which rounds to 0.
    """
    if isinstance(d_model, bool) or not isinstance(d_model, int):
        raise TypeError(f"d_model: expected an int, got {type(d_model).__name__} {d_model!r}")
    positive_int("d_model", d_model)
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"eps: expected a number, got {type(eps).__name__} {eps!r}")
    smallest = torch.finfo(torch.float32).tiny
    if not math.isfinite(eps) or eps < smallest:
        raise ValueError(f"eps: expected a finite number >= {smallest:.3g}, got {eps}")


def renamed(old: str, old_value: T | None, new: str, new_value: T | None) -> T | None:
    """An argument that had another name: `new_value`, or `old_value` given under the former name
    `old` (with a DeprecationWarning). Giving both is an error."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{old}: the former name of {new}; give only {new}, got both")
    warnings.warn(f"{old} is deprecated: call it {new}", DeprecationWarning, stacklevel=3)
    return old_value


def alias(name: str, value: T | None, field: str, current: T, default: T) -> T:
    """A dataclass field given under another name: `value` (given as `name`) unless None, else
    the field's `current` value. The two given and different is an error."""
    if value is None:
        return current
    if current not in (default, value):
        raise ValueError(
            f"{name}: another name for {field}; give one of them, got {name}={value!r} and "
            f"{field}={current!r}"
        )
    return value


def sentences(name: str, value: Any) -> Any:
    """A sequence of strings, not a single str (which would be read character by character)."""
    if isinstance(value, str):
        raise TypeError(
            f"{name}: expected a list of strings, got a single string (wrap it in a list)"
        )
    return value


def special_tokens(name: str, tokenizer: Any, needed: Iterable[str]) -> Any:
    """A tokenizer whose `special_tokens` include every one of `needed`."""
    missing = [t for t in needed if t not in getattr(tokenizer, "special_tokens", {})]
    if missing:
        raise ValueError(f"{name}: expected the special tokens {list(needed)}, missing {missing}")
    return tokenizer


def at_least(name: str, value: Any, bound: str, low: int, why: str = "") -> int:
    """An int >= another argument's value `low` (named `bound`); `why` says why."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        because = f" ({why})" if why else ""
        raise ValueError(f"{name}: expected {name} >= {bound}={low}{because}, got {value!r}")
    return int(value)


def broadcastable(name: str, shape: tuple[int, ...], earlier: tuple[int, ...]) -> None:
    """`shape` broadcasts with `earlier` (the shape built so far)."""
    try:
        torch.broadcast_shapes(shape, earlier)
    except RuntimeError:
        raise ValueError(
            f"{name}: shape {tuple(shape)} does not broadcast with the earlier masks' shape "
            f"{tuple(earlier)}"
        ) from None


def in_vocabulary(name: str, text: str, ids: Collection[str]) -> str:
    """A string of characters that each have an id."""
    for index, char in enumerate(text):
        if char not in ids:
            raise ValueError(
                f"{name}: expected only characters from the tokenizer's vocabulary, got {char!r} "
                f"at index {index}"
            )
    return text


def same_batch(name: str, t: Tensor, other: Tensor, other_name: str) -> Tensor:
    """A tensor with the batch size (dim 0) of `other`."""
    if t.shape[0] != other.shape[0]:
        raise ValueError(
            f"{name}: expected batch size {other.shape[0]} (the batch size of {other_name}), "
            f"got {t.shape[0]}"
        )
    return t


def targets(t: Any, logits: Tensor) -> Tensor:
    """Targets of the shape of `logits` without its last dim (one target per prediction)."""
    if not isinstance(t, Tensor) or t.shape != logits.shape[:-1]:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(
            f"targets: expected shape {tuple(logits.shape[:-1])} (logits without the vocab dim), "
            f"got {got}"
        )
    return t


def finite_logits(logits: Tensor, where: str) -> Tensor:
    """Logits without NaN or inf: argmax and sampling would read them silently as a token."""
    if not logits.isfinite().all():
        raise FloatingPointError(
            f"model: its logits {where} are not finite; check its weights and the input"
        )
    return logits


def token_stream(name: str, data: Any, n_ctx: int) -> Tensor:
    """A 1-d tensor of token ids longer than one window of `n_ctx` (its targets need one more)."""
    if not isinstance(data, Tensor) or data.ndim != 1 or data.numel() <= n_ctx:
        got = tuple(data.shape) if isinstance(data, Tensor) else type(data).__name__
        raise ValueError(
            f"{name}: expected a 1-d tensor longer than n_ctx={n_ctx}, got shape {got}"
        )
    return data


def has_keys(name: str, mapping: Any, keys: Iterable[str], what: str) -> None:
    """A mapping holding every one of `keys`; `what` says what it should be."""
    for key in keys:
        if key not in mapping:
            raise TypeError(f"{name}: expected {what}, but {key!r} is missing")


def text_of_characters(name: str, value: Any) -> str:
    """A str with at least one character."""
    text(name, value)
    if not value:
        raise ValueError(f"{name}: expected at least one character to build a vocabulary, got ''")
    return value


def hugging_face_model(name: str, model: Any, model_type: str, class_name: str) -> Any:
    """A Hugging Face `nn.Module` whose config has the `model_type` given."""
    found = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model, torch.nn.Module) or found != model_type:
        raise TypeError(
            f"{name}: expected a Hugging Face {class_name} (config.model_type {model_type!r}), "
            f"got {type(model).__name__} with model_type {found!r}"
        )
    return model
