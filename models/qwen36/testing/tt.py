"""Test support for the TT model (used by tests/tt/ and the TP probes): bf16 test checkpoints and a
one-layer harness that runs the same inputs through a TT layer and the pure-torch reference layer.

Test checkpoints are written in bf16, like real Qwen3.6 checkpoints: the TT loader then quantises from the
source dtype the real loader sees, and the fp32 reference runs on exactly the checkpoint's weights, so a TT
vs reference difference is the TT arithmetic (plus the bf8/bf4 conversion in the performance preset).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..checkpoint import load_checkpoint
from ..config import FULL, Qwen36Config
from ..reference.model import Qwen36Model
from ..tiny import PRESETS, random_weights, write_checkpoint
from ..tt.model.attention import AttentionContext
from ..tt.model.model import TTDecoderLayer, TTQwen36Model
from ..tt.model.model_config import PrecisionSetting, TTModelArgs
from ..tt.model.state import GDNLayerState, allocate_decode_inputs, allocate_state
from ..tt.model.weights import WeightLoader


def tp4_config() -> Qwen36Config:
    """The CI config with every head count doubled so that it splits over 1, 2 and 4 devices."""
    c = PRESETS["ci"]
    return replace(c, num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=12)


def small_tt_generator(ckpt, **kw):
    """The emulated-mesh TT generator the speculative and sampling tests share: accuracy preset, 128-token
    sequences in 32-token KV blocks (``prefill_chunk`` the model default unless given), no progress bars; ``kw``
    adds what a test needs (``require_mtp``, ``prefill_chunk``, ...)."""
    from ..tt.runtime.generator import Pages, build_generator

    pages = Pages(block_size=32, prefill_chunk=kw.pop("prefill_chunk", None))
    return build_generator(ckpt, "emulated-p150x2", precision="accuracy", max_seq_len=128, progress=False,
                           pages=pages, cache_dir=None, **kw)


def make_bf16_checkpoint(out_dir: str | Path, preset: str | Qwen36Config = "ci", seed: int = 0) -> Path:
    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    return write_checkpoint(out_dir, cfg, random_weights(cfg, seed, dtype=torch.bfloat16))


def gdn_channel_permutation(cfg: Qwen36Config, n: int) -> torch.Tensor:
    """Index p with permuted = original[p]: conv channels [q | k | v] -> device-major [q_d | k_d | v_d]."""
    kd, vd = cfg.gdn_key_dim, cfg.gdn_value_dim
    idx = torch.arange(cfg.gdn_conv_dim)
    q, k, v = idx[:kd], idx[kd:2 * kd], idx[2 * kd:]
    return torch.cat([torch.cat([q.chunk(n)[d], k.chunk(n)[d], v.chunk(n)[d]]) for d in range(n)])


class LayerHarness:
    """One decoder layer on the mesh and in the reference, driven with identical inputs."""

    def __init__(self, ckpt: Path, ctx, precision: PrecisionSetting, layer_id: int, max_seq_len: int = 256,
                 **args_kw):
        self.ttnn, self.mesh = ctx.ttnn, ctx.mesh_device
        reader = load_checkpoint(ckpt)
        self.cfg = reader.config
        self.args = TTModelArgs.from_config(self.cfg, ctx.num_devices, precision, max_seq_len=max_seq_len,
                                            prefill_chunk=64, block_size=32, **args_kw)
        weights = WeightLoader(reader, self.args, self.ttnn, self.mesh, progress=False).load(layers=[layer_id])
        self.model = TTQwen36Model(self.args, weights, self.ttnn, self.mesh)
        self.layer: TTDecoderLayer = self.model.layers[0]
        self.state = allocate_state(self.args, self.ttnn, self.mesh, [layer_id])
        self.inputs = allocate_decode_inputs(self.ttnn, self.mesh)
        self.ref = Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32, with_mtp=False)
        self.ref_layer = self.ref.layers[layer_id]
        self.ref_state = self.ref.new_state(1, max_seq_len).layers[layer_id]
        self.is_attention = self.cfg.layer_types[layer_id] == FULL
        self.pos = 0

    def to_device(self, x: torch.Tensor):
        """[1, T, H] torch -> [1, 1, T, H] activation on the mesh (replicated)."""
        return self.ttnn.from_torch(x[None].float(), dtype=self.ttnn.bfloat16, layout=self.ttnn.TILE_LAYOUT,
                                    device=self.mesh, memory_config=self.ttnn.DRAM_MEMORY_CONFIG)

    def from_device(self, t, rows: int) -> torch.Tensor:
        return self.model.to_host(t).float().reshape(1, rows, self.cfg.hidden_size)

    def _ctx(self, mode: str, rows: int) -> AttentionContext:
        if mode == "decode":
            self.model.copy_host_to_device(self.model.prepare_decode_inputs_host([0] * rows, self.pos), self.inputs)
            cos, sin = self.model.rope_rows(self.inputs.rope_idx)
            return AttentionContext("decode", cos, sin, self.state.page_table, pos=self.inputs.pos)
        return self.model.prefill_chunk_context(self.pos, rows, self.state.page_table, self.state.page_table_host)

    @torch.no_grad()
    def mixer(self, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token mixer (GDN or attention) on normed input x [1, T, H] -> (reference, TT) outputs [1, T, H]."""
        rows = x.shape[1]
        ctx = self._ctx(mode, rows) if self.is_attention else None
        st = self.state.layers[0]
        out = self.layer.mixer.forward(self.to_device(x), st, ctx if self.is_attention else mode)
        if self.is_attention:
            exp = self.ref_layer.self_attn(x, self.pos, self.ref_state)
        else:
            exp, _ = self.ref_layer.linear_attn(x, self.ref_state, mode="chunk" if mode == "prefill" else "recurrent")
        self.pos += rows
        return exp, self.from_device(out, rows)

    @torch.no_grad()
    def decoder_layer(self, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.shape[1]
        ctx = self._ctx(mode, rows)
        out = self.layer.forward(self.to_device(x), self.state.layers[0], ctx)
        exp, _ = self.ref_layer(x, self.pos, self.ref_state, gdn_mode="chunk" if mode == "prefill" else "recurrent")
        self.pos += rows
        return exp, self.from_device(out, rows)

    @torch.no_grad()
    def mlp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.layer.mlp.forward(self.to_device(x))
        return self.ref_layer.mlp(x), self.from_device(out, x.shape[1])

    def gdn_states(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{'recurrent': (ref, tt), 'conv': (ref, tt)} in the reference's layout."""
        st = self.state.layers[0]
        assert isinstance(st, GDNLayerState)
        ttnn = self.ttnn
        rec = ttnn.to_torch(st.recurrent, mesh_composer=ttnn.ConcatMeshToTensor(self.mesh, dim=0)).float()
        rec = rec.reshape(self.ref_state.recurrent.shape)  # [Hv, Dk, Dv] device-major -> the reference's [1, Hv, Dk, Dv]
        conv = ttnn.to_torch(st.conv, mesh_composer=ttnn.ConcatMeshToTensor(self.mesh, dim=3)).float()  # [1,1,K-1,C]
        perm = gdn_channel_permutation(self.cfg, self.args.num_devices)
        ref_conv = self.ref_state.conv[0][perm].t()[None, None]  # [1, 1, K-1, C] device-major
        return {"recurrent": (self.ref_state.recurrent, rec), "conv": (ref_conv.float(), conv)}


def read_scalar(step_state, buf) -> float:
    """Device 0's value of a [1,1,1,1] step-state buffer (``SpecDeviceState.n``, ``.pending``), read back eagerly."""
    ttnn = step_state.ttnn
    return float(ttnn.to_torch(ttnn.get_device_tensors(buf)[0]).reshape(-1)[0])


def device_position(backend) -> int:
    """The device-resident position n of a TTSpecBackend's step state."""
    return int(read_scalar(backend.step_state, backend.step_state.n))
