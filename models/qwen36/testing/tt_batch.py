"""Test support for batched TT decode (tt/runtime/batch.py, batch_buckets.py): the batch-1 TT run every user of a
batch must equal, NaN-poisoning a free slot, reading a slot's GDN rows, and the several-prompt CLI check."""
from __future__ import annotations

from pathlib import Path

import torch

from ..generation.plain import PlainResult, plain_generate
from ..tt.model.state import GDNLayerState, KVLayerState
from ..tt.runtime.batch import TTBatchDecoder
from ..tt.runtime.decode import LogitsRows, TTDecoder
from ..tt.runtime.generator import SMALL_PAGES, TTGenerator, build_generator
from .cli import run_cli_streams
from .tt import make_bf16_checkpoint

# Batched vs batch-1 on the same TT graph: every op is row-wise (a row of a [B, H] matmul sees the same tiles and
# accumulation order as the [1, H] one in the emulator's tile arithmetic), so the logits agree to this bound
# (measured: bit-equal); any cross-row leak or wrong slot would be O(1).
BATCH_VS_SINGLE_MAX_ABS = 1e-4


def random_prompt(n: int, seed: int) -> torch.Tensor:
    """``n`` seeded token ids below 512 (the CI checkpoint's vocabulary)."""
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def batch_test_checkpoint(tmp_path_factory) -> Path:
    """The bf16 CI checkpoint the batched-decode tests share (seed 0)."""
    return make_bf16_checkpoint(tmp_path_factory.mktemp("tt-batch-ci"), "ci", seed=0)


def batch_test_generator(ckpt: Path) -> TTGenerator:
    """The batch-1 generator on the emulated 1x2 mesh whose model the batch decoders run (accuracy preset)."""
    return build_generator(ckpt, "emulated-p150x2", precision="accuracy", max_seq_len=256, progress=False,
                           pages=SMALL_PAGES, cache_dir=None)


_single_cache: dict = {}


def batch_one_greedy(gen: TTGenerator, ids: torch.Tensor, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Batch-1 TT greedy: tokens and the logits row each was picked from (prefill row, then decode rows). Cached per
    (prompt, n) for the process: every caller builds ``gen`` with batch_test_generator on batch_test_checkpoint."""
    key = (tuple(ids.tolist()), n)
    if key not in _single_cache:
        logits = [gen.prefill(ids)]
        toks = [int(logits[0].argmax())]
        while len(toks) < n:
            row, _ = gen.decode_step(toks[-1])
            logits.append(row)
            toks.append(int(row.argmax()))
        gen.release_trace()  # the batch decoder's join allocates while its own trace is live, not the generator's
        _single_cache[key] = (toks, logits)
    return _single_cache[key]


def host_greedy(dec, prompts, max_new_tokens, arrivals=None, thinking=None) -> list[PlainResult]:
    """Greedy plain decoding on ``dec`` (a TTBatchDecoder or BucketedBatchDecoder) with every step's logits rows
    read back and kept (``LogitsRows``): one PlainResult per user."""
    picks = LogitsRows(dec.model.args.cfg.vocab_size, keep_logits=True)
    return plain_generate(TTDecoder(dec, picks), prompts, max_new_tokens, arrivals=arrivals, thinking=thinking)


def assert_users_match_single(gen, prompts, res, limits):
    """Every user's batched tokens equal its batch-1 run's, logits within BATCH_VS_SINGLE_MAX_ABS."""
    for u, p in enumerate(prompts):
        toks, logits = batch_one_greedy(gen, p, limits[u])
        assert res[u].tokens == toks, f"user {u} (prompt length {p.numel()})"
        diff = max(float((a - b).abs().max()) for a, b in zip(res[u].logits, logits))
        assert diff <= BATCH_VS_SINGLE_MAX_ABS, f"user {u}: batched vs batch-1 logits max abs {diff}"


def poison_slot(dec: TTBatchDecoder, slot: int) -> None:
    """NaN into the slot's GDN recurrent and conv rows and its KV pages, on every device."""
    ttnn, mesh = dec.ttnn, dec.mesh
    pages = dec.state.page_table_host[slot].tolist()
    for st in dec.state.layers:
        if isinstance(st, GDNLayerState):
            per = st.recurrent.shape[0] // dec.slots
            bufs = [(st.recurrent, slice(slot * per, (slot + 1) * per)), (st.conv, slice(slot, slot + 1))]
        else:
            assert isinstance(st, KVLayerState)
            bufs = [(st.k, pages), (st.v, pages)]
        for buf, rows in bufs:
            parts = [ttnn.to_torch(d).float().clone() for d in ttnn.get_device_tensors(buf)]
            for h in parts:
                h[rows] = float("nan")
            host = ttnn.from_torch(torch.cat(parts, 0), dtype=buf.dtype, layout=buf.layout,
                                   mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=0))
            ttnn.copy_host_to_device_tensor(host, buf)


def gdn_rows(dec: TTBatchDecoder, st: GDNLayerState) -> tuple[torch.Tensor, torch.Tensor]:
    """(recurrent [B, devices, Hv_d, Dk, Dv], conv [B, devices, K-1, Cd]) of one GDN layer, slot-major."""
    ttnn = dec.ttnn
    rec = torch.stack([ttnn.to_torch(d).float() for d in ttnn.get_device_tensors(st.recurrent)], 0)
    conv = torch.stack([ttnn.to_torch(d).float() for d in ttnn.get_device_tensors(st.conv)], 0)
    rec = rec.reshape(rec.shape[0], dec.slots, -1, *rec.shape[-2:]).transpose(0, 1)
    conv = conv.reshape(conv.shape[0], dec.slots, *conv.shape[-2:]).transpose(0, 1)
    return rec, conv


CLI_TEXTS = ["def add(a, b):\n", "import os\nimport sys\n"]


def batch_cli_equals_alone(capsys, base: list[str], texts: list[str] = CLI_TEXTS) -> list[str]:
    """Runs ``qwen36 <base>`` once per prompt, then with every prompt as one batch; asserts the batch's ``ids[i]``
    lines equal each prompt's own run and that stderr names the batch. Returns the batch run's stdout lines."""
    alone = []
    for t in texts:
        rc, out, err = run_cli_streams(capsys, *base, "--prompt", t)
        assert rc == 0, err
        alone.append(out.splitlines()[0].removeprefix("ids: "))
    rc, out, err = run_cli_streams(capsys, *base, *[a for t in texts for a in ("--prompt", t)])
    assert rc == 0, err
    lines = out.splitlines()
    assert [l for l in lines if l.startswith("ids[")] == [f"ids[{i}]: {a}" for i, a in enumerate(alone)]
    assert f"batch {len(texts)}" in err
    return lines


def record_emitted_logits(be) -> dict[int, list[torch.Tensor]]:
    """Every emitted token's fp32 logits row per slot of a B-slot ``TTSpecBackend`` (host rows), recorded as it runs:
    the join's prefill row, then rows 0..a of each committed verify (a step's accepted rows and its bonus row, an
    inject round's forced rows and the row after them). Compare with a plain decoder's ``keep_logits`` rows."""
    rows: dict[int, list[torch.Tensor]] = {s: [] for s in range(be.slots)}
    layout = be.layout  # the B-slot step layout (tt/spec/host_slots.py HostRows), whose commit the inject rounds call
    join, commit = be.decoder.join, layout.commit

    def join_rec(slot, prompt, **kw):
        logits = join(slot, prompt, **kw)
        rows[slot].append(logits.float().reshape(-1).clone())
        return logits

    def commit_rec(acceptances, forced=False):
        lg = be.verify_logits()
        for s, acc in acceptances.items():
            rows[s] += [lg[s, j].clone() for j in range(acc.num_accepted + 1)]
        return commit(acceptances, forced)

    be.decoder.join, layout.commit = join_rec, commit_rec
    return rows
