"""Probe gate-0b: cost of each phase of the TT speculative step at real Qwen3.6-27B shapes.

    verify_cost_ratio(K) = cost(K+1-row packed verify) / cost(1-row decode), K in --ks (default 1,2,3,7)
    draft: MTP reseed over the K+1 verify rows, then the chain; cost per drafted token = (draft - reseed) / K
    accept: greedy acceptance on device over the K+1 verify logits
    commit: per mechanism (pre-verify copies + conv select + ring index / masked re-advance + n, pending)

On the emulated mesh every figure is **modelled**: emulator counters (programs, bytes read per device by dtype,
collectives) turned into P150a milliseconds by tt_ops/cost_model.py. The same command on cards times each phase
with ``ttnn.synchronize_device`` before and after (after one untimed warm-up call that compiles it): **measured**.
The label comes from what ran.

Method: decode-cost's bench (probes/decode_cost.py: random bf16 weights at the real shapes, the first GDN and the
first attention layer built, the step at position ``--context - 1``). Per phase the counted regions are
extrapolated to every layer: embed + 48 x GDN layer + 16 x attention layer + head; the LM-head-sized parts (head,
MTP logits, acceptance, draft picks / logits copies) are scaled in bytes from the built vocab to 248320 (their
programs are not); the commit's per-GDN-layer part (measured as commit - commit without layer records) and the
mechanism's pre-verify copies are multiplied by the GDN layer count. Emulator byte correction: an embedding /
RoPE lookup reads one row per token, not the table (the verify's per-KV-head cache view is a 0-cost reshape view,
counted as none). The MTP head (one full layer + fc, shared LM head) is built once and not extrapolated.
``per_layer``: one GDN and one attention layer of the decode and of each verify, with the commit's per-GDN-layer
part beside the verify's (the verify defers its GDN state writes to the commit).

``--batch B`` (B > 1; 1, the default, is everything above): B users per step, every user at position
``--context - 1`` with its own KV pages and GDN slot. Costed the same way: the B-row plain decode (tt/runtime/batch.py),
and per K of ``--ks`` that the packed verify admits (``batch_verify_refusal``: B x (K+1) <= 32 rows, whole rows
of 8 cores above 8; the others are listed in ``ks_refused`` with the reason) the ONE B x (K+1)-row verify, the
batched acceptor and the per-user commit (``HostRowsState(users=B)`` and ``commit``), plus every mechanism's
commit at ``--commit-k``. verify_cost_ratio = packed verify / B-row decode. Plain decode tok/s per user = 1000 /
ms per step, aggregate = B x that. The draft is the batched device MTP of the backend (``PackedMTPHead``): the
reseed over the B x (K+1) verified rows and the chain of K drafts of B rows each (every user drafting K); the MTP
step = verify + accept + draft + commit, MTP tok/s per user at each acceptance scenario and aggregate = B x that.
B = 32 admits no K (32 x 2 > 32 rows): its record is the plain decode only.

Pieces: this module drives the steps (``measure``, its layouts ``DeviceRowsStep`` / ``HostRowsStep``); ``step_meter`` measures them (cost regions,
phase figures); ``step_figures`` turns phase figures into the record's step times, tok/s and calibrated band.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from qwen36.errors import UserError
from qwen36.probes.decode_cost import RandomCheckpoint, build_bench, build_config, router_correction
from qwen36.probes.records import ProbeReport
from qwen36.speculative.mechanisms import MECHANISMS

from .step_figures import (batch_mtp_tok_s, calibrated_summary, expected_distinct_experts, mtp_tok_s,
                           print_calibrated, step_ms)
from .step_meter import Cost, Meter, phase_figures, ranking, total

NAME = "gate-0b"
HELP = "verify_cost_ratio (K+1-row verify / 1-row decode), draft/reseed/commit/accept cost at 27B shapes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="27b", choices=["27b", "35b-a3b", "ci", "moe-ci"],
                   help="27b / 35b-a3b: real shapes (the MoE sibling built with 64 experts, router bytes added back); "
                        "ci / moe-ci: the tiny CI configs")
    p.add_argument("--precision", default="performance", help="accuracy | performance | performance-bf4")
    p.add_argument("--context", type=int, default=4096, help="sequence length at the counted step")
    p.add_argument("--ks", default="1,2,3,7", help="draft depths K")
    p.add_argument("--commit-k", type=int, default=3, help="K at which every commit mechanism is costed")
    p.add_argument("--vocab-sample", type=int, default=None,
                   help="vocabulary built (emulator default 4096, extrapolated to the real vocab; cards: the real one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=1,
                   help="users per step: B > 1 costs the batched plain decode (B rows) and the packed batched verify "
                        "(B x (K+1) rows, tt/spec/spec_backend.py B slots) at each K of --ks that verify admits; 1: the single-user "
                        "step above")


def _instrument(bench, cfg, real_cfg, real_vocab: int):
    """What the single-user and the batched measurement share before any step: the meter on the model's regions
    (embedding, RoPE rows), the LM-head vocab ratio (cards measure wall-clock, so they need the real vocabulary),
    the layer counts, and the MoE router correction. Every step here has <= 32 rows, so the router's extra tiles are
    those of one row (``decode_cost.router_correction`` at the real expert count).
    Returns (meter, emulated, ratio, n_gdn, n_attn, router_corr)."""
    from qwen36.tt.model.model_config import TensorGroup

    meter = Meter(bench)
    bench.model.region = meter.region
    meter.instrument(bench.model, "embed", gather="embed")
    meter.instrument(bench.model, "rope_rows", region_name=lambda idx: f"rope{int(idx.shape[-1])}", gather="rope")
    ratio = real_vocab / cfg.vocab_size
    if not meter.emulated and ratio != 1:
        raise UserError("gate-0b on cards measures wall-clock: build the real vocabulary (omit --vocab-sample)")
    router_corr = Cost()
    if cfg.is_moe and meter.emulated:
        rc = router_correction(cfg, real_cfg or cfg, 1, bench.dtype_name(TensorGroup.MOE_ROUTER),
                               bench.dtype_name(TensorGroup.MOE_ROUTING))
        router_corr = Cost({f"read:{k}": v for k, v in rc.items()})
    return meter, meter.emulated, ratio, len(cfg.gdn_layer_ids), len(cfg.attention_layer_ids), router_corr


def _record_header(bench, precision: str, n_gdn: int, n_attn: int, built_vocab: int, real_vocab: int,
                   context: int) -> dict:
    """The record fields that say what ran (both measurements)."""
    from qwen36.tt_ops.cost_model import LABEL

    return {
        # ttsim timings are simulator wall-clock: measured, but never card performance
        "label": LABEL if bench.ctx.is_emulated else (
            "measured on ttsim (simulator)" if bench.ctx.is_simulated else "measured"),
        "backend": bench.ctx.label,
        "precision": precision,
        "tp": bench.ctx.num_devices,
        "kv_heads_per_device": bench.args.hkv_d,
        "layers": {"gdn": n_gdn, "attention": n_attn},
        "vocab": {"built": built_vocab, "extrapolated_to": real_vocab},
        "context_tokens": context,
    }


class DeviceRowsStep:
    """One user with the verify's row inputs derived on device (``TTSpecBackend``'s one-user layout):
    ``SpecDeviceState``, the acceptor over the K+1 logits rows, ``TTMTPHead``'s reseed + chain (:func:`draft_phase`)."""

    def __init__(self, bench, meter, pos: int, ratio: float, batch: int = 1):
        self.bench, self.meter, self.pos, self.ratio, self.batch = bench, meter, pos, ratio, batch

    def refusal(self, k: int) -> str | None:
        return None

    def decode_inputs(self):
        from qwen36.tt.model.state import allocate_decode_inputs

        model = self.bench.model
        inputs = allocate_decode_inputs(self.bench.ttnn, self.bench.mesh)
        model.copy_host_to_device(model.prepare_decode_inputs_host([1], self.pos), inputs)
        return inputs

    def spec_state(self, k: int, mech: str):
        from qwen36.tt.spec.accept import DeviceAcceptor
        from qwen36.tt.spec.verify import SpecDeviceState

        b, vocab = self.bench, self.bench.model.args.cfg.vocab_size
        acc = DeviceAcceptor(b.ttnn, b.mesh, k=k, vocab=vocab, ring_heads=b.args.gdn_hv_d).allocate()
        step_state = SpecDeviceState(b.model, b.state, k, mech)
        step_state.attach_acceptor(acc)
        step_state.start(self.pos, 1)
        step_state.write_drafts([(7 * j + 3) % vocab for j in range(k)])
        return step_state, acc

    def accept(self, step_state, acc, vout, k: int):
        return acc.greedy(vout.out.logits, step_state.drafts)

    def commit(self, step_state, vout, res):
        from qwen36.tt.spec.commit import commit

        return commit(step_state, vout, res)

    def draft(self, mtp_w, step_state, acc, vout, k: int) -> dict:
        from qwen36.tt.spec.mtp import TTMTPHead

        return draft_phase(self.meter, self.bench.model, mtp_w, TTMTPHead, k, self.pos, self.ratio)


def measure(device: str, cfg, precision: str, context: int, ks, commit_k: int, seed: int, real_vocab: int,
            real_cfg=None, *, batch: int = 1, rows: str | None = None) -> dict:
    """gate-0b's figures for ``batch`` users in one of ``TTSpecBackend``'s step layouts (``rows``: "device", one
    user only, the default there; "host", the B-slot layout, the default above one user): the plain decode, and per
    K the verify, the acceptor, the draft and the shadow commit, plus every mechanism's commit at ``commit_k``.
    Counted and extrapolated as the module doc says; K whose packed verify the core grid cannot lay out are listed
    in ``ks_refused`` (host rows)."""
    from qwen36.tt_ops.cost_model import P150aCostModel

    from qwen36.tt.model.weights import WeightLoader, load_mtp_weights

    rows = rows or ("device" if batch == 1 else "host")
    if rows not in ("device", "host") or rows == "device" and batch != 1:
        raise ValueError(f"rows={rows!r} at batch {batch}: device rows take one user, host rows any number")
    bench = build_bench(device, cfg, precision, context, seed, probe=NAME, emulated_only=False, slots=batch)
    try:
        a = bench.args
        meter, emulated, ratio, n_gdn, n_attn, router_corr = _instrument(bench, cfg, real_cfg, real_vocab)
        step = (DeviceRowsStep if rows == "device" else HostRowsStep)(bench, meter, context - 1, ratio, batch)
        refused = {str(k): r for k in ks if (r := step.refusal(k)) is not None}
        admitted = [k for k in ks if str(k) not in refused]

        # the verify's per-KV-head cache view (a reshape keeping the last two dims) is a 0-cost view on cards and
        # is counted as one by the emulator (no program, no bytes): no correction needed
        def layers(regs) -> Cost:
            return total(((regs["embed"], 1), (regs["layer0"], n_gdn), (regs["layer1"], n_attn),
                          (router_corr, n_gdn + n_attn), (regs["head"].vocab_scaled(ratio), 1)))

        # ---- plain decode: one row per user, every user at context - 1 ------------------------------------
        inputs = step.decode_inputs()
        meter.run("decode", lambda: bench.model.decode_forward(inputs, bench.state))
        regs, corr = meter.take()
        decode = layers(regs).plus(corr)
        # one layer of each type: what advancing it by the step costs (the verify defers its GDN state writes to
        # the commit, whose per-layer part is listed beside it)
        per_layer = {"decode": {"gdn": regs["layer0"], "attention": regs["layer1"]}}

        def spec_state(k, mech):
            st, acc = step.spec_state(k, mech)
            meter.instrument(st, "pre_verify", region_name=lambda: "pre_verify")
            meter.take()
            return st, acc

        def verify_phase(st, acc, k):
            vout = meter.run("verify", st.verify)
            regs, corr = meter.take()
            inner = total(((regs["verify"], 1), (regs["embed"], -1), (regs["layer0"], -1), (regs["layer1"], -1),
                           (regs["head"], -1), (regs["pre_verify"], -1)))  # row inputs / bounds / plan setup
            cost = layers(regs).plus(inner).plus(corr)
            res = meter.run("accept", lambda: step.accept(st, acc, vout, k))
            accept = meter.take()[0]["accept"].vocab_scaled(ratio)
            return vout, res, cost, accept, regs["pre_verify"], {"gdn": regs["layer0"], "attention": regs["layer1"]}

        def commit_phase(st, vout, res, pre):
            no_layers = vout.without_gdn_kept()
            meter.run("commit", lambda: step.commit(st, vout, res))
            meter.run("commit_fixed", lambda: step.commit(st, no_layers, res))
            regs, _ = meter.take()
            gdn_part = regs["commit"].plus(regs["commit_fixed"], -1)
            return total(((regs["commit_fixed"], 1), (gdn_part, n_gdn), (pre, n_gdn))), gdn_part.plus(pre)

        cm = P150aCostModel()
        fig = lambda c: phase_figures(c, cm, emulated)  # noqa: E731
        verify, accept, commit_shadow, draft = {}, {}, {}, {}
        mtp_w = None
        if admitted:
            mtp_w = load_mtp_weights(WeightLoader(RandomCheckpoint(cfg, seed), a, bench.ttnn, bench.mesh,
                                                  progress=False))
        for k in admitted:
            st, acc = spec_state(k, "shadow_commit")  # the zero-copy default; the record keys below name it
            vout, res, v_cost, acc_cost, pre, v_layers = verify_phase(st, acc, k)
            verify[k], accept[k] = v_cost, acc_cost
            commit_shadow[k], commit_gdn = commit_phase(st, vout, res, pre)
            per_layer[f"verify_k{k}"] = {**v_layers, "commit_per_gdn_layer": commit_gdn}
            draft[k] = step.draft(mtp_w, st, acc, vout, k)
        commits, commit_refused = {}, step.refusal(commit_k)
        if commit_refused is None:
            for mech in MECHANISMS:
                st, acc = spec_state(commit_k, mech)
                vout, res, _, _, pre, _ = verify_phase(st, acc, commit_k)
                commits[mech] = commit_phase(st, vout, res, pre)[0]

        d_ms = fig(decode)["ms"]
        header = _record_header(bench, precision, n_gdn, n_attn, cfg.vocab_size, real_vocab, context)
        if rows == "device":
            out = {
                **header,
                "decode": fig(decode),
                "verify": {str(k): {"rows": k + 1, **fig(v)} for k, v in verify.items()},
                "verify_cost_ratio": {str(k): fig(v)["ms"] / d_ms for k, v in verify.items()},
                "verify_ms_per_extra_candidate": {str(k): (fig(v)["ms"] - d_ms) / k for k, v in verify.items()},
                "accept": {str(k): fig(v) for k, v in accept.items()},
                "draft": {str(k): {"total": fig(v["total"]), "reseed": fig(v["reseed"]),
                                   "per_drafted_token_ms": (fig(v["total"])["ms"] - fig(v["reseed"])["ms"]) / k}
                          for k, v in draft.items()},
            }
        else:
            out = {
                **header,
                "batch": batch,
                "ks_refused": refused,
                "decode": {"rows": batch, **fig(decode)},
                "plain_decode_tok_s": {"per_user": 1e3 / d_ms, "aggregate": batch * 1e3 / d_ms},
                "verify": {str(k): {"rows": batch * (k + 1), **fig(v)} for k, v in verify.items()},
                "verify_cost_ratio": {str(k): fig(v)["ms"] / d_ms for k, v in verify.items()},
                "accept": {str(k): fig(v) for k, v in accept.items()},
                "draft": {str(k): {"total": fig(v["total"]), "reseed": fig(v["reseed"]), "chain": fig(v["chain"]),
                                   "per_drafted_token_ms": fig(v["chain"])["ms"] / k}
                          for k, v in draft.items()},
            }
        out.update({
            "commit_shadow_commit_by_k": {str(k): fig(v) for k, v in commit_shadow.items()},
            "commit_k": commit_k,
            "commit": {m: fig(v) for m, v in commits.items()},
            **({"commit_refused": commit_refused} if commit_refused else {}),
            "per_layer": {name: {part: fig(c) for part, c in parts.items()} for name, parts in per_layer.items()},
        })
        out["step_ms_shadow_commit"] = step_ms(out, admitted)
        if emulated:
            out["calibrated"] = calibrated_summary(out, admitted, *([batch] if rows == "host" else []))
            if rows == "device":
                out["calibrated"]["ranking"] = {"decode": ranking(decode),
                                                **{f"verify_k{k}": ranking(v) for k, v in verify.items()}}
        if cfg.is_moe and rows == "device":
            out["moe"] = moe_record(bench, cfg, real_cfg or cfg, ks, n_gdn + n_attn, cm)
        if emulated:
            out["cost_model_constants"] = dataclasses.asdict(cm)
        return out
    finally:
        bench.close()


def moe_record(bench, cfg, real, ks, n_layers: int, cm) -> dict:
    """What a verify reads of the experts (one user's step): (K+1) x top-k expert slots, against the distinct
    experts a deduplicating verify would read (expected under uniform routing)."""
    e, k_top = real.num_experts, cfg.num_experts_per_tok
    mw = bench.weights.layers[0].mlp
    group = (mw.experts_gate_up.bytes_per_device() + mw.experts_down.bytes_per_device()) // cfg.num_experts
    return {
        "experts": e, "top_k": k_top, "expert_bytes_per_device": group,
        "note": "verify reads (K+1)*k expert slots (an expert two rows pick is read twice); a deduplicating "
                "verify would read the distinct experts: expected count modelled under uniform routing",
        "verify": {str(k): {"expert_slots_read": (k + 1) * k_top,
                            "expected_distinct_experts_uniform": expected_distinct_experts(e, k_top, k + 1),
                            "duplicate_expert_ms_per_step": ((k + 1) * k_top - expected_distinct_experts(
                                e, k_top, k + 1)) * group * n_layers / (cm.dram_bw_gbps * 1e9) * 1e3}
                   for k in ks}}


def draft_phase(meter: Meter, model, mtp_w, head_cls, k: int, pos: int, ratio: float) -> dict:
    """MTP reseed over K+1 rows + select + chain (``TTMTPHead.draft``); regions per body / logits call."""
    head = head_cls(model, mtp_w, k).allocate()
    r, h = k + 1, model.args.cfg.hidden_size
    inputs = head.allocate_draft_inputs()
    hidden = torch.randn(r, h, generator=torch.Generator().manual_seed(k))
    head.copy_host_to_device(head.host_draft_inputs([1] * r, hidden, pos, k // 2), inputs)
    meter.instrument(head, "body", region_name=lambda tokens, *_: f"body{int(tokens.shape[-1])}")
    meter.instrument(head, "logits", region_name=lambda *_: "logits")
    meter.take()
    meter.run("draft", lambda: head.draft(inputs.tokens, inputs.hidden, inputs.pos, inputs.select))
    gathered = list(meter.gathers)
    regs, corr = meter.take()
    zero = Cost()
    body_r, body_1, logits = regs[f"body{r}"], regs.get("body1", zero), regs["logits"]
    rope = total(((c, 1) for n, c in regs.items() if n.startswith("rope")))
    rest = total(((regs["draft"], 1), (body_r, -1), (body_1, -1), (logits, -1), (rope, -1)))  # picks, copies, select
    draft_total = total(((body_r, 1), (body_1, 1), (rope, 1), (logits.vocab_scaled(ratio), 1),
                         (rest.vocab_scaled(ratio), 1), (corr, 1)))
    meter.gathers = [g for g in gathered if g[1] == r]  # the reseed's own R-row gathers
    reseed = total(((body_r, 1), (regs[f"rope{r}"], 1), (meter.take()[1], 1)))
    return {"total": draft_total, "reseed": reseed}


# ---- batch B > 1: the batched plain decode and the packed B x (K+1) verify (TTSpecBackend B slots) ----------------
def batch_verify_refusal(batch: int, k: int) -> str | None:
    """Why the packed verify of ``batch`` users x (K+1) rows cannot run, or None. The bound is the one
    ``TTSpecBackend`` with B slots (tt/spec/spec_backend.py) refuses by, read from the same sources: at most ``TILE_ROWS`` rows
    (the decode-path attention puts one row per core) and, above one row of cores, whole rows of cores
    (``model_config.user_core_grid``)."""
    from qwen36.tt.model.gdn import TILE_ROWS
    from qwen36.tt.model.model_config import user_core_grid

    rows = batch * (k + 1)
    if rows > TILE_ROWS:
        return f"{batch} x (K+1 = {k + 1}) = {rows} verify rows: the decode-path attention takes at most {TILE_ROWS}"
    try:
        user_core_grid(rows)
    except ValueError as e:
        return f"{batch} x (K+1 = {k + 1}) = {rows} verify rows: {e}"
    return None


class HostRowsStep:
    """``batch`` users (one included) in the B-slot layout (``TTSpecBackend`` with host rows): the row inputs the
    backend's host side writes between replays (here written once, every user stepping K drafts from the same
    position with its own KV pages and GDN slot), ``HostRowsState(users=B)``, the batched acceptor, the per-user
    commit and the packed device MTP (:func:`packed_draft_phase`)."""

    def __init__(self, bench, meter, pos: int, ratio: float, batch: int):
        self.bench, self.meter, self.pos, self.ratio, self.batch = bench, meter, pos, ratio, batch

    def refusal(self, k: int) -> str | None:
        return batch_verify_refusal(self.batch, k)

    def decode_inputs(self):
        from qwen36.tt.model.state import allocate_decode_inputs

        model, batch = self.bench.model, self.batch
        for layer in model.layers:
            if hasattr(layer.mixer, "prepare_batch"):
                layer.mixer.prepare_batch(batch)
        inputs = allocate_decode_inputs(self.bench.ttnn, self.bench.mesh, batch=batch)
        model.copy_host_to_device(model.prepare_decode_inputs_host([1] * batch, [self.pos] * batch), inputs)
        return inputs

    def spec_state(self, k: int, mech: str):
        from qwen36.tt.spec.accept import DeviceAcceptor
        from qwen36.tt.spec.host_rows import HostRowsState

        b, batch, pos = self.bench, self.batch, self.pos
        vocab, heads, bs = b.model.args.cfg.vocab_size, b.args.hkv_d, b.args.block_size
        pt = b.state.page_table_host
        t = k + 1
        st = HostRowsState(b.model, b.state, k, mech, users=batch)
        acc = DeviceAcceptor(b.ttnn, b.mesh, k=k, vocab=vocab, batch=batch, ring_heads=b.args.gdn_hv_d).allocate()
        st.attach_acceptor(acc)
        st.start()
        ps = [pos + j for j in range(t)]
        drafts = [(7 * j + 3) % vocab for j in range(k)]
        st.write("tokens", torch.tensor([[1] + drafts] * batch, dtype=torch.int32).reshape(1, -1))
        st.write("rope_idx", torch.tensor([ps] * batch, dtype=torch.int32).reshape(1, -1))
        st.write("phys_rows", torch.tensor([[int(pt[u, p // bs]) * bs + p % bs for p in ps] for u in range(batch)],
                                           dtype=torch.int32).reshape(1, -1))
        st.write("bounds", torch.tensor(ps, dtype=torch.int32).repeat(batch * heads))
        st.write("head_page_table", (pt.to(torch.int32)[:, None, :] * heads
                                     + torch.arange(heads, dtype=torch.int32)[None, :, None]).reshape(batch * heads, -1))
        st.write("drafts", torch.tensor([drafts] * batch, dtype=torch.int32).reshape(1, batch, 1, k))
        st.write("row_mask", torch.ones(batch, t, 1))
        st.write("active", torch.ones(1, batch, 1, 1))
        return st, acc

    def accept(self, st, acc, vout, k: int):
        ttnn, vocab = self.bench.ttnn, self.bench.model.args.cfg.vocab_size
        return acc.greedy(ttnn.reshape(vout.out.logits, [1, self.batch, k + 1, vocab]), st.drafts)

    def commit(self, st, vout, res):
        from qwen36.tt.spec.commit import commit

        return commit(st, vout)

    def draft(self, mtp_w, st, acc, vout, k: int) -> dict:
        from qwen36.tt.spec.mtp_packed import PackedMTPHead

        return packed_draft_phase(self.meter, self.bench.model, mtp_w, PackedMTPHead, st, acc, vout, k, self.batch,
                                  self.pos, self.ratio)


def packed_draft_phase(meter: Meter, model, mtp_w, head_cls, st, acc, vout, k: int, batch: int, pos: int,
                       ratio: float) -> dict:
    """The batched device MTP (``PackedMTPHead``, as ``PackedMTPDrafter`` runs it) over every user drafting k:
    the reseed over the B x (K+1) verified rows with each user's row a_b selected (in the backend's commit trace)
    and the chain of K drafts, B rows per step (its draft trace). The chain's LM-head-sized parts (logits, picks,
    logits copies) are scaled in bytes to the real vocabulary; the reseed has none."""
    head = head_cls(model, mtp_w, k, batch).allocate()
    users = range(batch)
    head.write_reseed_inputs({b: k for b in users}, {b: pos for b in users})
    head.write_chain_inputs({b: k for b in users}, {b: pos for b in users}, {b: 1 for b in users})
    meter.instrument(head, "body", region_name=lambda tokens, *_: f"body{int(tokens.shape[-1])}")
    meter.instrument(head, "logits", region_name=lambda *_: "logits")
    meter.take()
    meter.run("reseed", lambda: head.reseed_select_batch(acc.result, vout.out.hidden, acc.count, st.active))
    regs, reseed_corr = meter.take()
    reseed = regs["reseed"].plus(reseed_corr)
    meter.run("chain", lambda: head.chain_batch(st.tokens, st.drafts))
    regs, corr = meter.take()
    zero = Cost()
    body, logits = regs.get(f"body{batch}", zero), regs["logits"]
    rope = total(((c, 1) for n, c in regs.items() if n.startswith("rope")))
    rest = total(((regs["chain"], 1), (body, -1), (logits, -1), (rope, -1)))  # picks, draft/logits copies, rows
    chain = total(((body, 1), (rope, 1), (logits.vocab_scaled(ratio), 1), (rest.vocab_scaled(ratio), 1), (corr, 1)))
    return {"total": reseed.plus(chain), "reseed": reseed, "chain": chain}


def print_figures(fig: dict, args: argparse.Namespace, ks, admitted) -> None:
    """The console summary of a gate-0b record (one user's step, or B users')."""
    lab, b = fig["label"], fig.get("batch", 1)
    users = f" batch {b}" if "batch" in fig else ""
    print(f"[{lab}] gate-0b {args.preset} {args.precision} tp{fig['tp']}{users} ({fig['kv_heads_per_device']} KV "
          f"heads/device) on {fig['backend']}, context {args.context}:")
    if "batch" in fig:
        pd = fig["plain_decode_tok_s"]
        print(f"  [{lab}] plain decode {b} rows: {fig['decode']['ms']:.2f} ms/step, {pd['per_user']:.1f} tok/s per "
              f"user, {pd['aggregate']:.1f} aggregate")
        for k, why in fig["ks_refused"].items():
            print(f"  K={k}: refused ({why})")
        if not admitted:
            print(f"  no K of --ks {','.join(map(str, ks))} fits the packed verify at batch {b}: plain decode only")
    else:
        print(f"  decode 1 row: {fig['decode']['ms']:.2f} ms")
    for k in map(str, admitted):
        v, d = fig["verify"][k], fig["draft"][k]
        extra = (f", +{fig['verify_ms_per_extra_candidate'][k]:.3f} ms/candidate"
                 if "verify_ms_per_extra_candidate" in fig else "")
        parts = (f"reseed {d['reseed']['ms']:.2f}, chain {d['chain']['ms']:.2f}" if "chain" in d
                 else f"reseed {d['reseed']['ms']:.2f}, {d['per_drafted_token_ms']:.2f}/token")
        print(f"  K={k}: verify {v['rows']} rows {v['ms']:.2f} ms (ratio {fig['verify_cost_ratio'][k]:.3f}{extra}), "
              f"accept {fig['accept'][k]['ms']:.3f}, {'packed MTP draft' if 'chain' in d else 'draft'} "
              f"{d['total']['ms']:.2f} ({parts}), commit(shadow) "
              f"{fig['commit_shadow_commit_by_k'][k]['ms']:.3f}, step {fig['step_ms_shadow_commit'][k]:.2f} ms")
    aggregate = fig.get("mtp_aggregate_tok_s_shadow_commit")
    for scen, by_k in fig["mtp_tok_s_shadow_commit"].items():
        cols = [f"K={k} {v:.1f}" + (f" ({aggregate[scen][k]:.1f} aggregate)" if aggregate else "")
                for k, v in by_k.items() if v is not None]
        if cols:
            print(f"  [{lab}] MTP tok/s{' per user' if aggregate else ''}, acceptance {scen}: " + ", ".join(cols)
                  + ("" if aggregate else f" (plain decode {1e3 / fig['decode']['ms']:.1f})"))
    if fig["commit"]:
        print(f"  commit at K={fig['commit_k']}: " + ", ".join(f"{m} {v['ms']:.3f} ms" for m, v in fig["commit"].items()))
    print_calibrated(fig, admitted)


def run(args: argparse.Namespace) -> ProbeReport:
    device = args.device if args.device != "reference" else "emulated-p150x2"
    ks = sorted({int(x) for x in str(args.ks).split(",") if x.strip()})
    vocab = args.vocab_sample
    if vocab is None:
        vocab = 4096 if device.startswith("emulated") else 1 << 30
    cfg, base = build_config(args.preset, vocab)
    if cfg.num_experts != base.num_experts and not device.startswith("emulated"):
        raise UserError("gate-0b on cards measures wall-clock: build the real expert count")
    if args.batch != 1:
        from qwen36.tt.model.gdn import TILE_ROWS
        from qwen36.tt.model.model_config import user_core_grid

        try:
            if not 1 <= args.batch <= TILE_ROWS:
                raise ValueError(f"the batched decode takes 1..{TILE_ROWS} users")
            user_core_grid(args.batch)
        except ValueError as e:
            raise UserError(f"--batch {args.batch}: {e}") from None
    fig = measure(device, cfg, args.precision, args.context, ks, args.commit_k, args.seed, base.vocab_size,
                  real_cfg=base, batch=args.batch)
    admitted = [k for k in ks if str(k) not in fig.get("ks_refused", {})]
    fig["mtp_tok_s_shadow_commit"] = mtp_tok_s(fig, admitted)  # per user
    if args.batch != 1:
        fig["mtp_aggregate_tok_s_shadow_commit"] = batch_mtp_tok_s(fig, admitted)
    ratios = [fig["verify_cost_ratio"][str(k)] for k in admitted]
    phases = [fig["decode"], *fig["verify"].values(), *fig["accept"].values(), *fig["commit"].values(),
              *fig["commit_shadow_commit_by_k"].values(), *(d["reseed"] for d in fig["draft"].values())]
    cells = [{"cell": "every phase costed", "pass": all(v["ms"] > 0 for v in phases)
              and all(d["per_drafted_token_ms"] > 0 for d in fig["draft"].values())}]
    if admitted:
        cells.insert(0, {"cell": "verify_cost_ratio >= 1 and increasing with K", "ratios": ratios,
                         "pass": all(r >= 1 for r in ratios) and all(x < y for x, y in zip(ratios, ratios[1:]))})
    print_figures(fig, args, ks, admitted)
    return ProbeReport(probe=NAME, backend=fig["backend"],
                       config={"preset": args.preset, "precision": args.precision, "context": args.context,
                               "ks": ks, "commit_k": args.commit_k,
                               **({"batch": args.batch} if args.batch != 1 else {}),
                               "vocab_built": cfg.vocab_size, "real_vocab": base.vocab_size, "seed": args.seed},
                       cells=cells, counters={"decode": {k: v for k, v in fig["decode"].items() if k != "bytes_read_per_device"}},
                       gate_complete=True, performance=fig)
