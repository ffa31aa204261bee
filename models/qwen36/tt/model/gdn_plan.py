"""What a multi-row step (a speculative verify) does with each GDN layer's state, as plain data.

The owner of the step (the speculative wing) decides per GDN layer where the conv window and the recurrent state go
(a :class:`GDNRoute`); the GDN layer reads that data, runs its ops, and leaves in the plan what a later commit needs
(a :class:`GDNKept` per layer). Nothing here calls back into the owner: the layer is told buffers and flags.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .state import GDNLayerState


@dataclass(frozen=True)
class GDNRoute:
    """Where one GDN layer's state goes in a multi-row step (all device tensors are persistent buffers).

    ``conv_write``: True advances the live conv state through all rows; False keeps it and the window (the commit
    selects the accepted row's). ``initial`` / ``final``: the recurrent state the rows start from and where the state
    after the last row goes (None: the live ``state.recurrent``). ``ring_idx``: ring mode, ``initial`` is a
    [T*B*Hv, Dk, Dv] ring whose block ``ring_idx[h]`` head h starts from, and the state after row t is written in
    place to block t*B*Hv + h (``final`` unused). ``row_mask``: [B, T, 1] multiplied into g and beta (0 makes a row
    an identity step: an inert row leaves the state bit for bit)."""

    conv_write: bool
    initial: Any = None
    final: Any = None
    ring_idx: Any = None
    row_mask: Any = None


@dataclass(frozen=True)
class GDNKept:
    """What one GDN layer leaves for the commit of a multi-row step: the recurrence inputs (g and beta after the
    row mask) to re-advance from, and the conv window [B, 1, Kc-1+T, Cd] ROW_MAJOR (conv state before the step,
    then the T rows' conv inputs) to select the accepted row's shift register from. ``layer`` is the
    ``TTGatedDeltaNet`` that ran (its :meth:`recurrence` re-advances)."""

    layer: Any
    state: GDNLayerState
    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    window: Any


@dataclass
class GDNStepPlan:
    """The GDN part of a multi-row step over ``users`` user slots: one route per GDN layer state (keyed by the
    state object's id) and, after the forward, what each layer kept (in layer order)."""

    users: int
    routes: dict = field(default_factory=dict)  # id(GDNLayerState) -> GDNRoute
    kept: list = field(default_factory=list)  # GDNKept, appended by each GDN layer's forward

    def route(self, state: GDNLayerState) -> GDNRoute:
        try:
            return self.routes[id(state)]
        except KeyError:
            raise ValueError("GDN step plan: no route for this GDN layer state (the plan was made for another "
                             "model state)") from None
