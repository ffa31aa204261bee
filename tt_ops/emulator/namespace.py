"""The emulating ``ttnn`` namespace handed to model code on the emulated mesh.

Attribute lookup, in order:

1. **Override table** (``registry.OVERRIDES``): ops and host functions the emulator implements itself
   (tensor creation/transfer, linear/matmul with card numerics, collectives, paged cache ops, ring-mode GDN, spec
   SDPA, traces, mesh mappers...). An override is reachable only if the name exists in the installed
   ttnn - the emulator never invents API.
2. **Registered ttnn ops** (``FastOperation``/``Operation``): wrapped so that each call validates the
   arguments against the real signature, checks the op's dtype/layout table, and runs
   ``ttnn.get_golden_function(op)`` once per device shard. Ops without a golden raise
   :class:`NotEmulatedError` naming the op.
3. **Submodules** (``ttnn.transformer``, ``ttnn.experimental``, ...) become sub-namespaces.
4. **Classes, enums and constants** are forwarded unchanged (``ttnn.bfloat16``, ``ttnn.MemoryConfig``,
   ``ttnn.WormholeComputeKernelConfig``...).
5. **Other plain functions** are forwarded, but refuse (NotEmulatedError) when handed an emulated
   tensor or mesh, or when they are device-touching (open/close device, ...).

Every device op goes through :meth:`Dispatcher.call`, which counts the work and records it when a
trace is being captured.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable

import torch

from . import registry
from .errors import EmulatorError, NotEmulatedError, TraceRuleError
from .faults import check_fault
from .goldens import golden_impl
from .dram_sharded_readers import account_readers
from .programs import collectives_for, programs_for
from .work import compute_work
from .signatures import dtype_layout_table, signature_of
from .tensor import (EmuMeshBase, EmuTensor, describe_tile, dtype_name, iter_tensors, map_shards, shard_bytes,
                     write_inplace)
from .trace import TraceStep
from .ttnn_import import ttnn

try:
    from ttnn.decorators import FastOperation, Operation

    _OP_TYPES: tuple = (FastOperation, Operation)
except ImportError:  # pragma: no cover
    _OP_TYPES = ()

# Device-touching plain callables of ttnn that have no meaning on the emulated mesh.
REFUSED = {
    "ttnn.open_device",
    "ttnn.close_device",
    "ttnn.open_mesh_device",
    "ttnn.close_mesh_device",
    "ttnn.manage_device",
    "ttnn.CreateDevice",
    "ttnn.CreateDevices",
    "ttnn.CloseDevice",
    "ttnn.CloseDevices",
    "ttnn.set_fabric_config",
    "ttnn.get_device_tensors_from_device",
    "ttnn.dump_device_memory_state",
    "ttnn.get_memory_view",
    "ttnn.ReadDeviceProfiler",
    "ttnn.SetDefaultDevice",
    "ttnn.GetDefaultDevice",
    "ttnn.create_submesh",
    "ttnn.light_metal_begin_capture",
    "ttnn.light_metal_end_capture",
    "ttnn.create_global_semaphore",
    "ttnn.create_global_circular_buffer",
}


# Ops that check their inputs' tiles themselves, with the device op's own message (Tenstorrent's tests expect it);
# every other op refuses a non-default tile by name in Dispatcher.check_inputs.
TILE_VALIDATING_OPS = {"ttnn.experimental.indexed_fused_update_cache"}


def bytes_by_dtype(tensors) -> dict:
    out: dict = {}
    for t in tensors:
        if not t.on_device:
            continue
        k = dtype_name(t.dtype)
        out[k] = out.get(k, 0) + shard_bytes(t._shards[0].shape, t.dtype, t.layout)
    return out


def read_placement(t) -> str:
    """Where a device tensor is read from, as a suffix of its ``bytes_read`` key (cost_model.py charges each kind
    at its own bandwidth): ``""`` DRAM-interleaved, ``"@l1"`` L1 (no DRAM traffic), ``"@dram_sharded/<banks>"``
    DRAM width-/height-sharded over that many banks (each reader streams one bank)."""
    mc = t.memory_config()
    if mc.buffer_type == ttnn.BufferType.L1:
        return "@l1"
    if mc.is_sharded() and mc.shard_spec is not None:
        return f"@dram_sharded/{mc.shard_spec.grid.num_cores()}"
    return ""


def _read_bytes_of(t) -> int:
    """Tile-accurate bytes of one device shard; a DRAM-sharded tensor counts its whole (padded) bank shards."""
    mc = t.memory_config()
    if mc.buffer_type == ttnn.BufferType.DRAM and mc.is_sharded() and mc.shard_spec is not None:
        spec = mc.shard_spec  # shard shapes are 2-D [height with the leading dims folded in, width]
        return spec.grid.num_cores() * shard_bytes(list(spec.shape), t.dtype, t.layout)
    return shard_bytes(t._shards[0].shape, t.dtype, t.layout)


def bytes_read_by_placement(tensors) -> dict:
    """:func:`bytes_by_dtype` for op inputs, keys suffixed with :func:`read_placement`."""
    out: dict = {}
    for t in tensors:
        if not t.on_device:
            continue
        k = dtype_name(t.dtype) + read_placement(t)
        out[k] = out.get(k, 0) + _read_bytes_of(t)
    return out


class Dispatcher:
    """Validates, counts, records (capture) and executes device ops on one emulated mesh."""

    def __init__(self, mesh):
        self.mesh = mesh

    def _bind_names(self, sig, args, kwargs) -> dict:
        """Map call arguments to parameter names (first overload whose positional list fits)."""
        named = dict(kwargs)
        for o in sig.overloads:
            if len(args) <= len(o.positional):
                for name, a in zip(o.positional, args):
                    named.setdefault(name, a)
                break
        return named

    def check_inputs(self, op_name: str, args, kwargs, real_op, inputs: list | None = None) -> None:
        """``inputs``: the EmuTensors in ``args``/``kwargs`` when the caller has listed them already."""
        mesh = self.mesh
        for t in (iter_tensors((args, kwargs)) if inputs is None else inputs):
            if t._deallocated and not (mesh.trace.replaying and not t._freed):
                raise EmulatorError(f"{op_name}: input tensor {t.logical_shape_list} was deallocated")
            if not t.on_device:
                raise EmulatorError(  # ttnn's device-operation launch guard words it so
                    f"{op_name}: Device Operations expect device tensors as inputs: input tensor "
                    f"{t.logical_shape_list} ({dtype_name(t.dtype)}) is on host; the op needs an allocated device "
                    "tensor (ttnn.from_torch(..., device=mesh) or ttnn.to_device)"
                )
            if t.mesh is not mesh:
                raise EmulatorError(f"{op_name}: input tensor lives on another mesh ({t.mesh!r})")
            mesh.trace.check_read(t, op_name)
            if t.num_shards != mesh.num_devices:
                raise EmulatorError(
                    f"{op_name}: input tensor has {t.num_shards} shards, mesh has {mesh.num_devices} devices"
                )
            if t._tile is not None and op_name not in TILE_VALIDATING_OPS:
                raise NotEmulatedError(
                    f"{op_name}: input tensor {t.logical_shape_list} uses a {describe_tile(t._tile)}; the emulator "
                    "computes only the default 32x32 tile (faces in order), so it refuses non-default tiles")
        if real_op is not None:
            table = dtype_layout_table(op_name, real_op)
            if table:
                sig = signature_of(op_name, real_op)
                named = self._bind_names(sig, args, kwargs)
                first = sig.overloads[0].positional[0] if sig.overloads and sig.overloads[0].positional else None
                for arg_name, rows in table.items():
                    t = named.get(first if arg_name == "__first__" else arg_name)
                    if not isinstance(t, EmuTensor):
                        continue
                    self._check_table(op_name, first if arg_name == "__first__" else arg_name, t, rows)

    _warned: set = set()

    def _check_table(self, op_name, shown, t, rows) -> None:
        """Apply the op's documented dtype/layout table under the mesh's ``op_table_policy``.

        ``strict``: any mismatch raises. ``layout`` (default): a layout the op does not list raises; a dtype it
        does not list is logged once (ttnn's tables list the tested dtypes; untested ones may still work on
        cards, e.g. fp32 sigmoid). ``warn``: both logged. ``off``: not checked.
        """
        policy = getattr(self.mesh, "op_table_policy", "layout")
        if policy == "off":
            return
        dn, ln = dtype_name(t.dtype), t.layout.name
        if any(dn in dts and ln in lys for dts, lys in rows):
            return
        layout_ok = any(ln in lys for _, lys in rows)
        allowed = "; ".join(f"{sorted(d)} in {sorted(l)}" for d, l in rows)
        msg = (f"{op_name}: {shown} is {dn} in {ln} layout; the op's documented table supports {allowed} "
               "('Supported data types and layouts' in the op docstring)")
        if policy == "strict" or (policy == "layout" and not layout_ok):
            raise EmulatorError(msg)
        key = (op_name, shown, dn, ln)
        if key not in Dispatcher._warned:
            Dispatcher._warned.add(key)
            from loguru import logger

            logger.warning(f"[emulator] {msg} - not raised under op_table_policy={policy!r}")

    def call(self, op_name: str, impl: Callable, args: tuple, kwargs: dict, *, real_op=None, collective_bytes=None,
             read_bytes=None, written_bytes=None):
        mesh = self.mesh
        mesh.check_open()
        if real_op is not None:
            signature_of(op_name, real_op).validate(args, kwargs)
        tensors = iter_tensors((args, kwargs))
        self.check_inputs(op_name, args, kwargs, real_op, tensors)
        mesh.note_program(op_name, args, kwargs)
        trace = mesh.trace
        capturing = trace.capturing

        def account(out, inputs=None):
            # accounting after the call, so that invalid calls fail with the op's own message first. ``inputs``: the
            # listed input tensors (not kept by this closure: a trace step stores it, and the mesh counts what holds
            # a capture buffer before freeing it)
            n = programs_for(op_name, args, kwargs, out)
            if n == 0:  # a view: no program, no data moved
                return {}, {}, None, 0, 0, None
            # an op's own accounting may return None for the calls it leaves to the default (every input read once)
            read = read_bytes(args, kwargs) if read_bytes else None
            if read is None:
                read = bytes_read_by_placement(iter_tensors((args, kwargs)) if inputs is None else inputs)
            # a DRAM-sharded matmul's weight bytes keyed by its readers per bank (validated like the device op)
            read = account_readers(op_name, args, kwargs, read, lambda t: dtype_name(t.dtype) + read_placement(t),
                                   _read_bytes_of)
            written = written_bytes(args, kwargs) if written_bytes else None
            if written is None:
                written = bytes_by_dtype(iter_tensors(out))
            cb = collective_bytes(args, kwargs, out) if collective_bytes else None
            return (read, written, cb, n, collectives_for(op_name, args, kwargs) if cb is not None else 0,
                    compute_work(op_name, args, kwargs))

        if capturing is not None:
            trace.dry = True
            try:
                out = impl(*args, **kwargs)
            finally:
                trace.dry = False
            step = _make_step(op_name, impl, args, kwargs, out, account)
            capturing.steps.append(step)
            read, written, cb, n, nc, work = account(out, tensors)
            if read_bytes is None and written_bytes is None and collective_bytes is None:
                step.static = (read, written, cb, n, nc, work)  # counts from shapes and layouts only: fixed per trace
            with mesh.counters._sink(capturing.counts):
                mesh.counters.record_op(op_name, read, written, collective_bytes=cb, live=False, programs=n,
                                        collectives=nc, work=work)
            return out
        check_fault(mesh, op_name)  # tests: an op failing on the device (faults.py)
        out = impl(*args, **kwargs)
        read, written, cb, n, nc, work = account(out, tensors)
        mesh.counters.record_op(op_name, read, written, collective_bytes=cb, programs=n, collectives=nc, work=work)
        return out


def _make_step(op_name, impl, args, kwargs, out, account):
    return TraceStep(op_name=op_name, impl=impl, args=args, kwargs=kwargs, outputs=out, account=account)


# --------------------------------------------------------------------------------------------------
# The namespace
# --------------------------------------------------------------------------------------------------
class OpProxy:
    """Callable standing in for one ttnn op on the emulated mesh."""


    def __init__(self, op_name, real_op, impl, dispatcher, collective_bytes=None, read_bytes=None,
                 written_bytes=None):
        self.op_name = op_name
        self.real_op = real_op
        self.impl = impl
        self.dispatcher = dispatcher
        self.collective_bytes = collective_bytes
        self.read_bytes = read_bytes
        self.written_bytes = written_bytes
        self.__doc__ = getattr(real_op, "__doc__", None)
        self.__name__ = op_name
        # host-side torch reference: ttnn.get_golden_function(op) reads it (Tenstorrent's tests call it)
        self.golden_function = getattr(real_op, "golden_function", None)

    def __call__(self, *args, **kwargs):
        return self.dispatcher.call(
            self.op_name, self.impl, args, kwargs, real_op=self.real_op, collective_bytes=self.collective_bytes,
            read_bytes=self.read_bytes, written_bytes=self.written_bytes,
        )

    def __repr__(self):
        return f"<emulated op {self.op_name}>"


class HostFunction:
    """Host-side / control function override (tensor transfer, traces, mappers): validated, not counted."""


    def __init__(self, name, fn, real, mesh):
        self.name = name
        self.fn = fn
        self.real = real
        self.mesh = mesh
        self.__doc__ = getattr(real, "__doc__", None)
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        if self.real is not None and registry.validate_host(self.name):
            signature_of(self.name, self.real).validate(args, kwargs)
        return self.fn(self.mesh, *args, **kwargs)

    def __repr__(self):
        return f"<emulated host function {self.name}>"


class _Refused:
    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NotEmulatedError(
            f"{self.name} touches real devices and is not available on the emulated mesh; "
            "open devices only through tt_ops.device.open_mesh(...)"
        )


class _GuardedFunction:
    """A forwarded plain ttnn function that refuses emulated tensors/meshes (it would hit C++)."""

    def __init__(self, name, fn):
        self.name = name
        self.fn = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, (EmuTensor, EmuMeshBase)) or any(True for _ in iter_tensors(a)):
                raise NotEmulatedError(
                    f"{self.name} is a plain ttnn function that works on real device objects; it has no emulation"
                )
        return self.fn(*args, **kwargs)


class _InstanceShim(type):
    """Metaclass: ``isinstance(x, ttnn.Tensor)`` / ``ttnn.MeshDevice`` work for emulated objects."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls._emulated_type())

    def __call__(cls, *args, **kwargs):
        raise NotEmulatedError(
            f"constructing ttnn.{cls.__name__} directly is not emulated; use ttnn.from_torch / tt_ops.device.open_mesh"
        )


class Tensor(metaclass=_InstanceShim):
    @staticmethod
    def _emulated_type():
        return EmuTensor


class MeshDevice(metaclass=_InstanceShim):
    @staticmethod
    def _emulated_type():
        return EmuMeshBase


SHIMS = {"ttnn.Tensor": Tensor, "ttnn.MeshDevice": MeshDevice}


class EmulatedTTNN(types.SimpleNamespace):
    """``ttnn`` as seen by model code on the emulated mesh. See the module docstring."""

    def __init__(self, mesh, path: str = "ttnn", real_module=ttnn):
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_real", real_module)
        object.__setattr__(self, "_dispatcher", mesh.__dict__.get("_dispatcher") or Dispatcher(mesh))
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "is_emulated", True)

    def __repr__(self):
        return f"<emulating namespace {self._path} on {self._mesh.label_short}>"

    def __dir__(self):
        return sorted(set(dir(self._real)))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        cache = self._cache
        if name in cache:
            return cache[name]
        full = f"{self._path}.{name}"
        registry.load_all()
        real = getattr(self._real, name)  # AttributeError for names the installed ttnn lacks
        value = self._resolve(full, name, real)
        cache[name] = value
        return value

    def _resolve(self, full: str, name: str, real: Any) -> Any:
        spec = registry.OVERRIDES.get(full)
        if spec is not None:
            if spec.kind == "op":
                return OpProxy(full, real if isinstance(real, _OP_TYPES) else None, spec.fn, self._dispatcher,
                               collective_bytes=spec.collective_bytes, read_bytes=spec.read_bytes,
                               written_bytes=spec.written_bytes)
            return HostFunction(full, spec.fn, real, self._mesh)
        if full in REFUSED:
            return _Refused(full)
        if full in SHIMS:
            return SHIMS[full]
        if _OP_TYPES and isinstance(real, _OP_TYPES):
            return OpProxy(full, real, golden_impl(full, real), self._dispatcher)
        if isinstance(real, types.ModuleType):
            return EmulatedTTNN(self._mesh, full, real)
        if inspect.isclass(real):
            return real
        if callable(real) and not isinstance(real, (int, float, str)):
            if type(real).__name__ in ("nb_func", "function", "builtin_function_or_method"):
                return _GuardedFunction(full, real)
            return real
        return real

    def __setattr__(self, key, value):
        raise AttributeError("the emulating ttnn namespace is read-only")
