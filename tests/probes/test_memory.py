"""memory probe at CI size: the per-card plan's parts add up to what the allocations would hold, KV and GDN state
grow with batch and context as the state allocator sizes them, and the largest context is the last page that fits."""
from __future__ import annotations

import pytest

from qwen36.probes.records import read_records


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    from qwen36.cli import main

    path = tmp_path_factory.mktemp("mem") / "mem.jsonl"
    assert main(["probe", "memory", "--device", "emulated-p150x2", "--preset", "ci", "--batch", "1,8",
                 "--max-len", "256,1024", "--records", str(path)]) == 0
    (r,) = read_records(path)
    return r


def test_memory_plan_ci(record):
    from qwen36.probes.memory import CARD_BYTES, largest_context, plan
    from qwen36.tiny import PRESETS

    cfg = PRESETS["ci"]
    m = record["performance"]
    assert record["verdict"] == "pass" and m["label"] == "modelled (allocation plan)"
    assert m["card_bytes"] == CARD_BYTES == 32 * 1024 ** 3
    rows = {(r["batch"], r["max_len"]): r for r in m["plans"]}
    assert set(rows) == {(1, 256), (1, 1024), (8, 256), (8, 1024)}
    # KV: K and V of every attention layer and of the MTP layer, whole pages per user; GDN: one slot per user
    assert m["kv_layers"] == len(cfg.attention_layer_ids) + 1
    assert rows[(8, 1024)]["kv"] == 8 * rows[(1, 1024)]["kv"] == 32 * rows[(1, 256)]["kv"]
    assert rows[(8, 256)]["gdn_conv_state"] == 8 * rows[(1, 256)]["gdn_conv_state"] > 0
    bs, per_tok = m["block_size"], m["kv_bytes_per_token_per_attention_layer"]
    assert per_tok > 0 and rows[(1, 256)]["kv"] == -(-256 // bs) * bs * m["kv_layers"] * per_tok
    for r in rows.values():
        assert r["total"] == r["weights"] + r["mtp"] + r["kv"] + r["gdn_conv_state"] + r["trace"]
        assert r["headroom"] == CARD_BYTES - r["total"] and r["fits"]
    # the largest context is capped by the model's positions here (a tiny model); a made-up card that holds just
    # one user's pages shows the page rule
    assert largest_context(m, 1) == m["max_position_embeddings"] // bs * bs
    small = dict(m, card_bytes=plan(m, 1, 4 * bs)["total"] + 1)
    assert largest_context(small, 1) == 4 * bs
    assert not plan(small, 1, 5 * bs)["fits"]


def test_memory_l1_per_core_of_a_decode_step(record):
    """The decode step's L1 buffers (the norm's width shards the DRAM-sharded MLP matmuls read, their L1 outputs) are
    charged per core by the emulator; the peak is above what was held before the step and within a Blackhole bank."""
    l1 = record["performance"]["l1_per_core"]
    assert l1["bank_bytes"] == 1_572_864 - 111_744 and l1["banks"] == 110
    assert len(l1["peak_bytes"]) == 2 and l1["peak_bytes"][0] == l1["peak_bytes"][1], "TP=2: the same on both chips"
    assert l1["held_before_step_bytes"][0] < l1["peak_bytes"][0] <= l1["bank_bytes"]
