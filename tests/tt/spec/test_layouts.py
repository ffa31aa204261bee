"""The TT speculative classes serve one user and B slots; the two step layouts (device rows: one user; host rows:
B slots) refuse the combinations they cannot run, in one line, before anything is allocated (no generator or model
is needed to see it)."""
from __future__ import annotations

import pytest

from qwen36.generation.sampling import SamplingParams
from qwen36.tt.runtime.sampler_transform import SamplerStages
from qwen36.tt.spec.mtp import TTMTPHead
from qwen36.tt.spec.mtp_packed import PackedMTPHead
from qwen36.tt.spec.spec_backend import BatchSpecError, TTSpecBackend
from qwen36.tt.spec.host_rows import HostRowsState
from qwen36.tt.spec.verify import SpecDeviceState


def host_drafter(history, k):
    return [0] * k


def test_backend_layout_refusals():
    with pytest.raises(ValueError, match="rows='host'"):  # several users need host-written row inputs
        TTSpecBackend(None, drafter=host_drafter, slots=2, k=1, rows="device")
    with pytest.raises(ValueError, match="first draft"):  # one user picks K at its first draft, params at join
        TTSpecBackend(None, drafter=host_drafter, k=2)
    with pytest.raises(ValueError, match="first draft"):
        TTSpecBackend(None, drafter=host_drafter, params=SamplingParams(temperature=1.0))
    with pytest.raises(BatchSpecError, match="depths="):  # per-step depth switching is the one-user layout's
        TTSpecBackend(None, drafter=host_drafter, slots=2, k=3, depths=[1, 3])
    with pytest.raises(BatchSpecError, match="verify width k"):
        TTSpecBackend(None, drafter=host_drafter, slots=2)
    with pytest.raises(ValueError, match="rows must be"):
        TTSpecBackend(None, drafter=host_drafter, rows="hosted")
    with pytest.raises(ValueError, match="slots must be"):
        TTSpecBackend(None, drafter=host_drafter, slots=0)
    # per-user params are the host rows' (one user takes its params at join())
    with pytest.raises(ValueError, match="stages are the host rows'"):
        TTSpecBackend(None, drafter=host_drafter, stages=SamplerStages.of([SamplingParams(temperature=1.0)], 512))


def test_step_state_and_head_layout_refusals():
    with pytest.raises(ValueError, match="HostRowsState"):  # device-derived rows hold one user's position
        SpecDeviceState(None, None, 2, "snapshot", users=2)
    with pytest.raises(ValueError, match="users must be"):
        HostRowsState(None, None, 2, "snapshot", users=0)
    with pytest.raises(ValueError, match="slots must be"):
        PackedMTPHead(None, None, 2, slots=0)
    with pytest.raises(ValueError, match="draft depth k"):
        TTMTPHead(None, None, 0)
