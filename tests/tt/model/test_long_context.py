"""Long context at CI size: prefill and decode past 16k positions on the emulated mesh, against the reference.

The CI model with a 17k-position KV: every attention KV row before position P = 16,896 holds random K/V (the same
values in the TT paged cache, in shuffled physical pages, and in the reference's cache), the GDN state starts at zero
in both, and an 80-token prompt is prefilled from P in chunks of 64 (the second partial), then 4 tokens are decoded.
That runs the long-context paths of the 27B at a small shape: chunked SDPA with its chunk start deep in the cache
(and a program config whose q/k chunk sizes divide that start), the chunk's own pages looked up past entry 256 of a
shuffled page table, RoPE rows gathered at positions > 16k, the paged decode SDPA over 17k positions, and the fused
KV update at those positions. Gates: the model PCC gates of tests/tt/model/test_model.py on the logits, and
ATTN_ROWS_GATE on the attention layer's own output rows, which a wrong position or page moves far past it (the
prefix keys at 3x a normed key's scale make each row's softmax pick a few of the 16,896 prefix positions)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from qwen36.reference.model import Qwen36Model
from qwen36.numerics import PCC_GATES, comp_pcc
from qwen36.tiny import make_bf16_checkpoint
from support.tt_hooks import layer_kv_from_host
from qwen36.tiny import PRESETS
from qwen36.tt.model.model_config import SDPA_PREFILL_CHUNKS, sdpa_prefill_chunk_size
from qwen36.tt.runtime.generator import TTGenerator

pytest.importorskip("ttnn")

START = 16_896  # past 16k; a multiple of the 64-row KV page
PROMPT, DECODE = 80, 4
CFG = dataclasses.replace(PRESETS["ci"], max_position_embeddings=32_768)
# the attention layer's output rows (its input carries three TT GDN layers' error, so not the one-layer gate): 0.99939
# measured; with the prefill's RoPE rows 64 positions off 0.646, with the chunk's own pages read from the wrong
# physical pages 0.979 (a permuted prefix alone is invisible: attention is a set operation over its keys)
ATTN_ROWS_GATE = 0.999


def test_sdpa_prefill_chunk_size_divides_the_start():
    assert sdpa_prefill_chunk_size(0, 256) == 256 and sdpa_prefill_chunk_size(0, 80) == 64
    assert sdpa_prefill_chunk_size(262_144 - 256, 256) == 256
    assert sdpa_prefill_chunk_size(3_840 + 64, 256) == 64  # a prefix-cache resume on a 64-row page
    assert sdpa_prefill_chunk_size(START, 64) == 64 and sdpa_prefill_chunk_size(START + 64, 16) == 32
    for start in range(0, 4096, 32):
        c = sdpa_prefill_chunk_size(start, 256)
        assert c in SDPA_PREFILL_CHUNKS and start % c == 0
    with pytest.raises(ValueError, match="not a multiple of 32"):
        sdpa_prefill_chunk_size(48, 256)


@pytest.mark.slow
def test_prefill_and_decode_past_16k_match_the_reference(tmp_path):
    ckpt = make_bf16_checkpoint(tmp_path, CFG, seed=0)
    ref = Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CFG.vocab_size, (PROMPT + DECODE,), generator=gen)
    attn = CFG.layer_types.index("full_attention")
    # keys at 3x a normed key's scale: softmax weights concentrate on a few prefix positions, so the attention
    # output is those positions' values, and a wrong page or bound changes it outright
    k, v = (s * torch.randn(CFG.num_key_value_heads, START, CFG.head_dim, generator=gen).to(torch.bfloat16).float()
            for s in (3.0, 1.0))

    state = ref.new_state(1, START + PROMPT + DECODE + 1)
    state.layers[attn].k[0, :, :START], state.layers[attn].v[0, :, :START] = k, v
    state.pos = START
    ref_attn = []  # the attention mixer's output rows: what a wrong page, position or bound changes outright
    hook = ref.layers[attn].self_attn.register_forward_hook(lambda m, a, out: ref_attn.append(out.detach()))
    with torch.no_grad():
        exp = ref(ids[None], state).logits[0]  # teacher-forced: prompt rows, then the decode rows
    hook.remove()

    tt = TTGenerator.from_checkpoint(ckpt, "emulated-p150x2", precision="accuracy", max_seq_len=START + 256,
                                     progress=False, prefill_chunk=64, use_trace=False)
    try:
        model, st = tt.model, tt.state
        mixer, tt_attn = model.layers[attn].mixer, []
        forward = mixer.forward
        mixer.forward = lambda *a, **kw: tt_attn.append(forward(*a, **kw)) or tt_attn[-1]
        pages = st.page_table_host.shape[1]
        shuffled = torch.randperm(pages, generator=gen).to(torch.int32)[None]
        st.page_table_host.copy_(shuffled)
        ttnn = model.ttnn
        ttnn.copy_host_to_device_tensor(
            ttnn.from_torch(shuffled, dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT,
                            mesh_mapper=ttnn.ReplicateTensorToMesh(model.mesh)), st.page_table)
        layer_kv_from_host(model, st.layers[attn], st.page_table_host, k, v)
        st.pos = START
        got = model.prefill_forward(ids[:PROMPT], st, all_rows=True)
        ok, msg = comp_pcc(exp[:PROMPT], got, PCC_GATES["model_prefill"])
        assert ok, f"prefill logits from position {START}: {msg}"
        for i in range(DECODE):
            logits, _ = tt.decode_step(int(ids[PROMPT + i]))
            ok, msg = comp_pcc(exp[PROMPT + i], logits, PCC_GATES["model_prefill"])
            assert ok, f"decode logits at position {START + PROMPT + i}: {msg}"
        assert st.pos == START + PROMPT + DECODE
        got_attn = torch.cat([model.to_host(t).float().reshape(-1, CFG.hidden_size) for t in tt_attn])
        ok, msg = comp_pcc(ref_attn[0].reshape(-1, CFG.hidden_size), got_attn, ATTN_ROWS_GATE)
        assert ok, f"attention mixer rows at positions {START}..{START + PROMPT + DECODE - 1}: {msg}"
    finally:
        tt.close()
