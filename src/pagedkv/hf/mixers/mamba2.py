"""Adapters for transformers' Mamba2 (SSD) mixers: Mamba2, Bamba, Nemotron-H, GraniteMoeHybrid, Falcon-H1.

The five mixer classes run the same math (transformers' torch path of ``Mamba2Mixer.forward``)::

    zxbcdt = in_proj(h)                          # [T, I + (I + 2GN) + H]
    z, xBC, dt = split(zxbcdt)                   # gate [T, I], conv input [T, I + 2GN], dt [T, H]
    xBC = act(conv1d(xBC))                       # depthwise causal conv of kernel K (act: silu)
    x, B, C = split(xBC)                         # [T, H, P], [T, G, N], [T, G, N]
    y = SSD(x, dt, A=-exp(A_log), B, C, D)       # dt = clamp(softplus(dt + dt_bias), *time_step_limit)
    y = gated_rms_norm(y, z)                     # RMS over each of G groups of I / G channels
    out = out_proj(y)                            # [T, D]

with I = H * P. What differs is parametrized by `_Variant`:

- Falcon-H1 scales the mixer input by ``ssm_in_multiplier`` before ``in_proj`` and the projection by the
  muP vector (the ``mup_vector`` buffer that ``FalconH1Model`` registers on every mixer; a mixer built on
  its own has none). Its gated norm is optional (``mamba_rms_norm``; without it the output is
  ``y * silu(z)``) and, when present, normalises before gating by default (``mamba_norm_before_gate``);
  the other four always gate first (``MambaRMSNormGated`` and its copies).
- Nemotron-H clamps dt to ``(time_step_min, inf)`` whatever ``config.time_step_limit`` says; the limit is
  read from the module (``module.time_step_limit``), which holds each class's own choice.

State per layer (`state_spec`, slot dimension excluded): the conv window ``(I + 2GN, K - 1)`` in the
model dtype (the last K - 1 conv *inputs*, `pagedkv.ops.conv_state`) and the SSD state ``(H, P, N)`` in
float32 (`pagedkv.ops.ssd`). Dtypes follow transformers: projections and the conv output in the model
dtype, the SSD in float32 with its output kept in float32 through the gated norm, cast to the model
dtype for ``out_proj``. The ``attention_mask`` and ``seq_idx``/``cu_seqlens`` inputs of transformers'
forward have no counterpart here: a packed ragged batch has no padding and the ops keep requests apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.hf.mixers.base import ForwardFn, MixerAdapter, StateBatch
from pagedkv.ops.conv_state import causal_conv1d
from pagedkv.ops.ssd import ssd_scan

__all__ = ["ADAPTERS"]

_SILU = ("silu", "swish")  # transformers' ACT2FN names of the activation `causal_conv1d` applies itself


@dataclass(frozen=True)
class _Dims:
    """A mixer's sizes: H heads of P channels, G groups of B/C with state size N, conv kernel K."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    kernel_size: int

    @property
    def intermediate(self) -> int:
        """I = H * P: the x and gate width."""
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """I + 2GN: the conv's channels (x, B, C)."""
        return self.intermediate + 2 * self.groups * self.state_size

    @classmethod
    def of(cls, module: Any) -> _Dims:
        """Read from any of the five mixer classes (they share these attribute names).

        Raises ValueError when ``intermediate_size != num_heads * head_dim`` (transformers views x as
        ``[T, H, P]``, so such a module could not run its own forward either).
        """
        dims = cls(
            int(module.num_heads), int(module.head_dim), int(module.n_groups), int(module.ssm_state_size),
            int(module.conv_kernel_size),
        )  # fmt: skip
        if int(module.intermediate_size) != dims.intermediate:
            raise ValueError(
                f"{type(module).__name__}: intermediate_size {module.intermediate_size} != num_heads * head_dim "
                f"= {dims.heads} * {dims.head_dim}"
            )
        return dims


@dataclass(frozen=True)
class _GatedNorm:
    """The gated RMSNorm between the SSD and ``out_proj``.

    Attributes:
        weight: [I], or None for no norm at all: the output is then ``y * silu(z)`` (Falcon-H1 without
            ``mamba_rms_norm``).
        eps: added to the mean square.
        groups: the RMS runs over each of `groups` consecutive runs of ``I / groups`` channels.
        norm_before_gate: normalise then multiply by ``silu(z)`` (Falcon-H1's default), else gate first
            (``MambaRMSNormGated``: Mamba2, Bamba, Nemotron-H, GraniteMoeHybrid).
    """

    weight: torch.Tensor | None
    eps: float
    groups: int
    norm_before_gate: bool

    def __call__(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y [T, I] float32 (the SSD output), gate z [T, I] in the model dtype -> [T, I] float32."""
        if self.weight is None:
            return y * torch.nn.functional.silu(gate)  # [T, I]; transformers takes silu in the gate's dtype
        silu_gate = torch.nn.functional.silu(gate.to(torch.float32))  # [T, I]
        if not self.norm_before_gate:
            y = y * silu_gate  # [T, I]
        rows, width = y.shape
        grouped = y.reshape(rows, self.groups, width // self.groups)  # [T, G', I / G']
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)  # [T, G', I / G']
        y = grouped.reshape(rows, width) * self.weight.to(torch.float32)  # [T, I]
        if self.norm_before_gate:
            y = y * silu_gate  # [T, I]
        return y


@dataclass(frozen=True)
class _Variant:
    """What one mixer class does differently around the shared math.

    Attributes:
        project: (module, h [T, D]) -> zxbcdt [T, 2I + 2GN + H], the input projection in the model dtype.
        gated_norm: module -> its `_GatedNorm`.
    """

    project: Callable[[Any, torch.Tensor], torch.Tensor]
    gated_norm: Callable[[Any], _GatedNorm]


def _project(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``in_proj(h)``: h [T, D] -> [T, 2I + 2GN + H]."""
    out: torch.Tensor = module.in_proj(hidden)
    return out


def _project_falcon(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Falcon-H1's muP projection ``in_proj(h * ssm_in_multiplier) * mup_vector``: h [T, D] -> [T, 2I + 2GN + H].

    Raises ValueError when the mixer has no ``mup_vector`` (``FalconH1Model`` registers it; a mixer built
    on its own cannot run transformers' forward either).
    """
    mup = getattr(module, "mup_vector", None)  # [1, 1, 2I + 2GN + H]
    if not isinstance(mup, torch.Tensor):
        raise ValueError(
            "FalconH1Mixer has no mup_vector: FalconH1Model registers it; build the mixer through the model"
        )
    out: torch.Tensor = module.in_proj(hidden * module.ssm_in_multiplier) * mup.reshape(-1)  # [T, 2I + 2GN + H]
    return out


def _norm_gate_first(module: Any) -> _GatedNorm:
    """``MambaRMSNormGated`` and its copies: gate, then RMS over groups of ``norm.group_size`` channels."""
    norm = module.norm
    groups = int(norm.weight.shape[0]) // int(norm.group_size)
    return _GatedNorm(norm.weight, float(norm.variance_epsilon), groups, norm_before_gate=False)


def _norm_falcon(module: Any) -> _GatedNorm:
    """``FalconH1RMSNormGated`` (``norm.n_groups`` groups, ``norm.norm_before_gate``), or only the gate
    when ``mamba_rms_norm`` is off (``module.norm`` is then an ``nn.Identity``)."""
    if not module.mamba_rms_norm:
        return _GatedNorm(None, 0.0, 1, norm_before_gate=False)
    norm = module.norm
    return _GatedNorm(norm.weight, float(norm.variance_epsilon), int(norm.n_groups), bool(norm.norm_before_gate))


def _state_spec(
    module: torch.nn.Module, model_dtype: torch.dtype
) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
    """(conv ``(I + 2GN, K - 1)`` in `model_dtype`, SSD ``(H, P, N)`` in float32) for one layer."""
    dims = _Dims.of(module)
    shapes = ((dims.conv_dim, dims.kernel_size - 1), (dims.heads, dims.head_dim, dims.state_size))
    return shapes, (model_dtype, torch.float32)


def _forward(
    variant: _Variant,
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    batch: StateBatch,
    states: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """The mixer over a packed ragged batch (contract: `pagedkv.hf.mixers.base`).

    hidden_states [1, T, D] with request b on rows ``batch.input_row_offsets[b]:[b + 1]``;
    states = (conv [num_slots, I + 2GN, W >= K - 1] model dtype, ssm [num_slots, H, P, N] float32).
    Returns [1, T, D] in the dtype of `hidden_states`; writes each request's new conv window and SSD state
    to its slot ``batch.slots[b]`` (starting from zeros where ``batch.has_state[b]`` is False, without
    reading the slot) and leaves every other slot untouched. The projections, the conv and the norm run
    once over all T rows; the ops batch the requests.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(f"hidden_states must be [1, T, D], got {tuple(hidden_states.shape)}")
    rows = hidden_states.shape[1]
    if sum(batch.lengths) != rows:
        raise ValueError(f"the batch has {sum(batch.lengths)} rows, hidden_states {rows}")
    if len(states) != 2:
        raise ValueError(f"a Mamba2 layer keeps 2 states (conv, ssm), got {len(states)}")
    m: Any = module
    dims = _Dims.of(m)
    conv_state, ssm_state = states
    slots, has_state, offsets = batch.slots, batch.has_state, batch.input_row_offsets

    zxbcdt = variant.project(m, hidden_states[0])  # [T, 2I + 2GN + H]
    gate, xbc, dt = zxbcdt.split([dims.intermediate, dims.conv_dim, dims.heads], dim=-1)  # [T, I], [T, I+2GN], [T, H]
    fused_silu = m.activation in _SILU
    xbc = causal_conv1d(
        xbc, conv_state, m.conv1d.weight.squeeze(1), m.conv1d.bias, slots, has_state, offsets,
        "silu" if fused_silu else None, decode=batch.decode,
    )  # fmt: skip  # [T, I + 2GN]
    if not fused_silu:
        xbc = m.act(xbc)  # [T, I + 2GN]
    group_width = dims.groups * dims.state_size
    x, b, c = xbc.split([dims.intermediate, group_width, group_width], dim=-1)  # [T, I], [T, GN], [T, GN]
    low, high = m.time_step_limit
    y = ssd_scan(
        x.reshape(rows, dims.heads, dims.head_dim).to(torch.float32),  # float32 x: the output stays float32
        dt, -torch.exp(m.A_log.to(torch.float32)),
        b.reshape(rows, dims.groups, dims.state_size), c.reshape(rows, dims.groups, dims.state_size),
        m.D, ssm_state, slots, has_state, batch.scan_offsets,
        dt_bias=m.dt_bias, dt_softplus=True, time_step_limit=(float(low), float(high)), chunk_size=int(m.chunk_size),
    )  # fmt: skip  # [T, H, P] float32
    y = variant.gated_norm(m)(y.reshape(rows, dims.intermediate), gate)  # [T, I] float32
    out: torch.Tensor = m.out_proj(y.to(hidden_states.dtype))  # [T, D]
    return out.unsqueeze(0)  # [1, T, D]


def _forward_fn(variant: _Variant) -> ForwardFn:
    """`_forward` bound to one class's variant."""

    def forward(
        module: torch.nn.Module, hidden_states: torch.Tensor, batch: StateBatch, states: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        return _forward(variant, module, hidden_states, batch, states)

    return forward


_PLAIN = _Variant(project=_project, gated_norm=_norm_gate_first)
_FALCON = _Variant(project=_project_falcon, gated_norm=_norm_falcon)

ADAPTERS: dict[str, MixerAdapter] = {
    name: MixerAdapter(mamba_type="mamba2", state_spec=_state_spec, forward=_forward_fn(variant))
    for name, variant in (
        ("Mamba2Mixer", _PLAIN),
        ("BambaMixer", _PLAIN),
        ("NemotronHMamba2Mixer", _PLAIN),
        ("GraniteMoeHybridMambaLayer", _PLAIN),
        ("FalconH1Mixer", _FALCON),
    )
}
"""transformers mixer class name -> its adapter."""
