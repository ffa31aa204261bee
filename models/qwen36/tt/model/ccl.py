"""The model's collectives in the form Tenstorrent captures in traces: async CCLs with persistent semaphores.

Why not ``ttnn.all_reduce`` / ``ttnn.all_gather``: in ttnn 0.81.1 their program factories allocate global
semaphores and synchronise the mesh from the host each time a program is built
(``ttnn/cpp/ttnn/operations/ccl/all_gather/device/all_gather_multicast_factory.cpp`` and
``all_gather_factory.cpp``, ``create_mesh_workload``: ``create_global_semaphore`` then ``Synchronize``).
Neither can be recorded in a trace. Tenstorrent's traced decode paths instead create the semaphores once,
before capture, and pass them to the ``ttnn.experimental`` async forms, cycling between two sets so that
back-to-back collectives never share one (``models/tt_transformers/tt/ccl.py``, ``TT_CCL``; the qwen36
demo's ``models/demos/blackhole/qwen36/tt/tp_common.py`` takes the same ``tt_ccl`` object). ``TTCCL`` is
that owner for this model: one per mesh, created when the model is built (never inside a capture).
"""
from __future__ import annotations

import weakref

from .model_config import activation_memory_config

_OWNERS: dict = {}  # id(mesh) -> (reference to the mesh, TTCCL)


def _ref(obj):
    """A weak reference where the object takes one (the emulated mesh), else a strong one: ttnn's nanobind
    MeshDevice is not weak-referenceable, and a card process opens one mesh, so holding it costs nothing."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class TTCCL:
    """Persistent global semaphores + the two collectives the model uses, on a (1, N) mesh (cluster axis 1)."""

    CYCLE = 2  # semaphore sets alternated between consecutive collectives (tt_transformers does the same)

    def __init__(self, ttnn, mesh):
        # weak where possible, so that the registry below does not keep emulated meshes alive
        self._ttnn, self._mesh = _ref(ttnn), _ref(mesh)
        grid = mesh.compute_with_storage_grid_size()
        cores = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(grid.x - 1, grid.y - 1))})

        def sems(n):
            return [ttnn.create_global_semaphore(mesh, cores, 0) for _ in range(n)]

        self._barrier = [sems(1) for _ in range(self.CYCLE)]
        self._ag = [sems(2) for _ in range(self.CYCLE)]
        self._rs = [sems(3) for _ in range(self.CYCLE)]
        self._ar1 = [sems(1)[0] for _ in range(self.CYCLE)]  # the single-op all-reduce takes one semaphore
        self._i = {"barrier": 0, "ag": 0, "rs": 0, "ar1": 0}
        self._reduce_buffers: dict = {}  # (grid, shard shape, dtype) -> persistent buffer of all_reduce_sharded

    @property
    def ttnn(self):
        return self._ttnn()

    @property
    def mesh(self):
        return self._mesh()

    def _next(self, kind: str, pool):
        i = self._i[kind]
        self._i[kind] = (i + 1) % self.CYCLE
        return pool[i]

    def all_reduce(self, t, memory_config=None):
        """Sum over the mesh row; every device gets the sum (one async all-reduce)."""
        ttnn = self.ttnn
        return ttnn.experimental.all_reduce_async(
            t, cluster_axis=1, mesh_device=self.mesh, barrier_semaphores=self._next("barrier", self._barrier),
            rs_global_semaphores=self._next("rs", self._rs), ag_global_semaphores=self._next("ag", self._ag),
            math_op=ttnn.ReduceType.Sum, topology=ttnn.Topology.Linear,
            memory_config=memory_config or activation_memory_config(ttnn))

    @staticmethod
    def _buffer_key(memory_config, dtype) -> tuple:
        spec = memory_config.shard_spec
        return (str(spec.grid), tuple(int(v) for v in spec.shape), str(dtype))

    def prepare_reduce_buffer(self, memory_config, dtype) -> None:
        """Allocate (once, before any trace capture) the persistent buffer :meth:`all_reduce_sharded` needs for a
        result in ``memory_config`` (L1 WIDTH_SHARDED): the same cores, each shard N x the output shard wide, where
        each core gathers every device's copy of its output shard before summing them (the device op requires
        buffer shard volume >= N x output shard volume, on a superset of the output's cores). One buffer serves
        every layer: the collectives run one after another on one command queue."""
        key = self._buffer_key(memory_config, dtype)
        if key in self._reduce_buffers:
            return
        import torch

        ttnn, n = self.ttnn, self.mesh.get_num_devices()
        spec = memory_config.shard_spec
        rows, width = int(spec.shape[0]), int(spec.shape[1]) * n
        cores = spec.grid.num_cores()
        mc = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.L1,
                               ttnn.ShardSpec(spec.grid, (rows, width), ttnn.ShardOrientation.ROW_MAJOR))
        self._reduce_buffers[key] = ttnn.from_torch(
            torch.zeros(1, 1, rows, width * cores), dtype=dtype, layout=ttnn.TILE_LAYOUT, device=self.mesh,
            memory_config=mc, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def all_reduce_sharded(self, t, memory_config):
        """Sum over the mesh row of an L1 WIDTH_SHARDED ``t`` into ``memory_config`` (L1 WIDTH_SHARDED) as one
        program and one collective: ``experimental.all_reduce_async``'s single-op form (a persistent buffer tensor
        and one semaphore), against the composite form's reduce-scatter + all-gather (two of each). ttnn 0.81.1
        refuses this form for a DRAM input on Blackhole and for any layout but WIDTH_SHARDED (its device op's
        validation; the emulator applies it), so only a result that is already L1 width-sharded (the DRAM-sharded
        MLP down projection, tt/model/mlp.py) takes it. Needs :meth:`prepare_reduce_buffer` first."""
        key = self._buffer_key(memory_config, t.dtype)
        if key not in self._reduce_buffers:
            raise RuntimeError(f"all_reduce_sharded: no persistent buffer for {key}; call prepare_reduce_buffer "
                               "when the model is built (allocating one inside a trace capture is not allowed)")
        ttnn = self.ttnn
        return ttnn.experimental.all_reduce_async(
            t, self._reduce_buffers[key], cluster_axis=1, mesh_device=self.mesh,
            multi_device_global_semaphore=self._next("ar1", self._ar1), memory_config=memory_config,
            topology=ttnn.Topology.Linear)

    def all_gather(self, t, dim: int, memory_config=None):
        """Concatenate the per-device shards along ``dim`` on every device (one async all-gather)."""
        ttnn = self.ttnn
        return ttnn.experimental.all_gather_async(
            t, dim=dim, cluster_axis=1, mesh_device=self.mesh, topology=ttnn.Topology.Linear,
            multi_device_global_semaphore=self._next("ag", self._ag),
            barrier_semaphore=self._next("barrier", self._barrier)[0],
            memory_config=memory_config or activation_memory_config(ttnn))


def ccl_for(ttnn, mesh) -> TTCCL:
    """The mesh's TTCCL, created on first call. Model constructors call it, so that the semaphores exist before
    any trace capture (creating them is a device allocation, which a capture may not contain)."""
    entry = _OWNERS.get(id(mesh))
    if entry is not None and entry[0]() is mesh:
        return entry[1]
    for key in [k for k, (ref, _) in _OWNERS.items() if ref() is None]:
        del _OWNERS[key]  # meshes that are gone
    owner = TTCCL(ttnn, mesh)
    _OWNERS[id(mesh)] = (_ref(mesh), owner)
    return owner


def all_reduce(ttnn, t, num_devices: int):
    """Sum row-parallel partials over the mesh (no collective at width 1): what every TP layer (GDN, attention, MLP,
    MoE) ends with."""
    if num_devices == 1:
        return t
    return ccl_for(ttnn, t.device()).all_reduce(t, memory_config=activation_memory_config(ttnn))
