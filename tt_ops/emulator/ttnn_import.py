"""Single import point for the real ttnn module used by the emulator (host-side only).

Importing ttnn does not need a device. Host conversions (bfloat8_b/bfloat4_b packing) need
``TT_METAL_MOCK_CLUSTER_DESC_PATH`` to point at a cluster descriptor; the emulated mesh sets it when it
opens (see :func:`tt_ops.emulator.mesh.ensure_mock_cluster`). Nothing here touches device APIs.
"""

import ttnn  # noqa: F401  (re-exported)

__all__ = ["ttnn"]
