"""Single import point for the real ttnn module used by the emulator (host-side only).

Importing ttnn does not need a device. Host conversions (bfloat8_b/bfloat4_b packing) need
``TT_METAL_MOCK_CLUSTER_DESC_PATH`` to point at a cluster descriptor; the emulated mesh sets it when it
opens (see :func:`tt_ops.emulator.mesh.ensure_mock_cluster`). Nothing here touches device APIs. The import goes
through :func:`qwen36.tt_ops.ttnn_env.import_ttnn`, which keeps ttnn's import-time and device-layer log lines
out of the user's output.
"""

from ..ttnn_env import import_ttnn

ttnn = import_ttnn(emulated=True)

__all__ = ["ttnn"]
