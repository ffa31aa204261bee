"""Fingerprints of what the emulated mesh computes, for comparing hosts: ``python -m qwen36.testing.host_fingerprint
OUT.json [--part ops|model|all]``.

A card computes every element of a tile alike, whatever the host that drives it. The emulator must too (rule N8,
docs/emulator_ops.md): the same inputs must give the same bits under any ``ATEN_CPU_CAPABILITY`` (scalar, AVX2,
AVX-512), any torch thread count, and any number of other rows sharing a call. ``tests/emulator/test_host_independence.py``
runs this module in subprocesses under those settings and compares the JSON they write, key by key.

* ``ops``: every elementwise, fused-activation, reduction, norm, matmul, attention and GDN op the model uses, on
  inputs built from integers (torch's normal sampler is itself host-dependent), each called with 1 row and with
  24 rows; the record holds both results' SHA-256 and whether row 0 of the 24-row call equals the 1-row call.
* ``model``: the shipped checkpoint on the emulated P150a x2 mesh: prefill logits, plain greedy decode logits and
  tokens, a traced greedy speculative run with the device MTP head (tokens, accepted counts) and a batched
  speculative run of two users (tokens, accepted counts); and the weights ``qwen36.tiny.random_weights`` generates
  for the test checkpoints (the ``ci`` and ``moe-ci`` presets, fp32 and bf16), which every test built on a generated
  checkpoint relies on being the same model on every host.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from importlib.resources import files

import torch

ROWS = 24
# not a multiple of any SIMD width: a 1-row call leaves a scalar tail that a 24-row call runs in its vector loop
WIDTH = 40
PROMPTS = [[1734, 4064, 17, 279, 1076, 4064, 17, 279], [17, 279, 1076, 5, 99, 1734]]


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    if t.is_floating_point():
        t = t.to(torch.float32)
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def int_tensor(seed: int, *shape: int, scale: float = 2.0 ** -12) -> torch.Tensor:
    """Values k * scale for integers k in [-2^14, 2^14): exact in bf16-free fp32, the same on every host."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2 ** 14), 2 ** 14, shape, generator=g).to(torch.float32) * scale


def op_fingerprints() -> dict:
    from ..tt.model.model_config import compute_config_norm
    from ..tt_ops.device import open_mesh

    out = {}
    with open_mesh("emulated-p150", trace_region_size=100_000) as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device

        def dev(x, dtype=None):
            return ttnn.from_torch(x, dtype=dtype or ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh)

        def host(t):
            return ttnn.to_torch(t)

        hifi = compute_config_norm(ttnn)  # HiFi4, fp32 Dst: the last bits survive to the output
        w = dev(int_tensor(90, 256, 96, scale=2.0 ** -16), ttnn.bfloat16)
        norm_w = dev(int_tensor(91, 1, 1, 1, WIDTH) + 1.0)
        unary = {
            "softplus_fused": lambda x: ttnn.multiply(x, x, input_tensor_a_activations=[ttnn.UnaryOpType.SOFTPLUS]),
            "sigmoid_fused": lambda x: ttnn.multiply(x, x, input_tensor_b_activations=[ttnn.UnaryOpType.SIGMOID]),
            "silu_fused": lambda x: ttnn.multiply(x, x, input_tensor_a_activations=[ttnn.UnaryOpType.SILU]),
            "sigmoid_accurate": lambda x: ttnn.sigmoid_accurate(x),
            "silu": lambda x: ttnn.silu(x),
            "exp": lambda x: ttnn.exp(x),
            "log": lambda x: ttnn.log(ttnn.add(ttnn.multiply(x, x), 0.5)),
            "relu": lambda x: ttnn.relu(x),
            "divide": lambda x: ttnn.divide(x, ttnn.add(ttnn.multiply(x, x), 1.0)),
            "softmax": lambda x: ttnn.softmax(x, dim=3, numeric_stable=True),
            "cumsum": lambda x: ttnn.cumsum(x, dim=3),
            "sum_sfpu": lambda x: ttnn.sum(x, dim=3, keepdim=True, compute_kernel_config=hifi),
            "sum_fpu": lambda x: ttnn.sum(x, dim=3, keepdim=True),
            "rms_norm": lambda x: ttnn.rms_norm(x, epsilon=1e-6, weight=norm_w, compute_kernel_config=hifi),
        }
        for name, fn in unary.items():
            x = int_tensor(1, 1, 1, ROWS, WIDTH)
            one = host(fn(dev(x[:, :, :1])))
            many = host(fn(dev(x)))
            out[f"op:{name}"] = [digest(one), digest(many), bool(torch.equal(one[:, :, 0], many[:, :, 0]))]
            xb = int_tensor(2, 1, 1, ROWS, WIDTH)  # the bf16 form of the same op
            one, many = host(fn(dev(xb[:, :, :1], ttnn.bfloat16))), host(fn(dev(xb, ttnn.bfloat16)))
            out[f"op:{name}:bf16"] = [digest(one), digest(many), bool(torch.equal(one[:, :, 0], many[:, :, 0]))]
        x = int_tensor(3, 1, 1, ROWS, 256)
        for name, kw in (("linear_hifi4_fp32dest", {"compute_kernel_config": hifi}), ("linear_default", {})):
            one = host(ttnn.linear(dev(x[:, :, :1]), w, dtype=ttnn.float32, **kw))
            many = host(ttnn.linear(dev(x), w, dtype=ttnn.float32, **kw))
            out[f"op:{name}"] = [digest(one), digest(many), bool(torch.equal(one[:, :, 0], many[:, :, 0]))]
        one = host(ttnn.linear(dev(x[:, :, :1]), w, dtype=ttnn.float32, activation="silu", compute_kernel_config=hifi))
        many = host(ttnn.linear(dev(x), w, dtype=ttnn.float32, activation="silu", compute_kernel_config=hifi))
        out["op:linear_silu"] = [digest(one), digest(many), bool(torch.equal(one[:, :, 0], many[:, :, 0]))]
        # GDN recurrence: one token vs the same token first in a 4-token call (the verify's per-token states)
        b, h, kd, vd = 1, 2, 32, 32
        q, k, v = (int_tensor(10 + i, b, 4, h, kd, scale=2.0 ** -15) for i in range(3))
        g, beta = -int_tensor(13, b, 4, h).abs() * 8, int_tensor(14, b, 4, h).abs() * 4
        h0 = int_tensor(15, b, h, kd, vd, scale=2.0 ** -14)
        res = {}
        for t_len in (1, 4):
            o, st = ttnn.transformer.fused_recurrent_gated_delta_rule(
                *(dev(z[:, :t_len]) for z in (q, k, v, g, beta)), initial_state=dev(h0), output_per_token_state=True)
            res[t_len] = (host(o), host(st))
        out["op:gdn_recurrent"] = [digest(res[1][0]), digest(res[1][1]), digest(res[4][0]), digest(res[4][1]),
                                   bool(torch.equal(res[1][1][:, 0], res[4][1][:, 0]))]
        # paged SDPA decode: one user vs the same user among four
        nkv, dh, bs = 1, 64, 32
        kc, vc = (int_tensor(20 + i, 4, nkv, bs, dh) for i in range(2))
        qd = int_tensor(22, 1, 4, 8, dh)
        sd = {}
        for users in (1, 4):
            pt = torch.arange(users, dtype=torch.int32).reshape(users, 1)
            pos = torch.tensor([5, 17, 31, 9][:users], dtype=torch.int32)
            y = ttnn.transformer.paged_scaled_dot_product_attention_decode(
                dev(qd[:, :users]), dev(kc, ttnn.bfloat16), dev(vc, ttnn.bfloat16),
                ttnn.from_torch(pt, dtype=ttnn.int32, device=mesh),
                cur_pos_tensor=ttnn.from_torch(pos, dtype=ttnn.int32, device=mesh))
            sd[users] = host(y)
        out["op:paged_sdpa_decode"] = [digest(sd[1]), digest(sd[4]), bool(torch.equal(sd[1][:, 0], sd[4][:, 0]))]
        out.update(kda_fingerprints(ttnn, mesh, dev, host))
    return out


def kda_fingerprints(ttnn, mesh, dev, host) -> dict:
    """The fused KDA / GDN ops: a 32-token call vs the same tokens first in a 64-token call."""
    out = {}
    widths, c = (32, 32, 64), 128
    x, hist = int_tensor(40, 1, 64, c), int_tensor(41, 1, 3, c)
    taps = [dev(int_tensor(42 + i, 1, 1, c, scale=2.0 ** -10), ttnn.bfloat16) for i in range(4)]
    start = ttnn.from_torch(torch.tensor([0]), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    h = ttnn.from_torch(hist, dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    conv = {}
    for t_len in (32, 64):
        q, k, v = ttnn.experimental.kda.qkv_causal_conv1d_silu(
            dev(x[:, :t_len], ttnn.bfloat16), h, *taps, *widths, actual_start=start, predecessor_carry=h,
            program_config=ttnn.QkvCausalConv1dSiluProgramConfig(channel_chunk_size=c))
        conv[t_len] = torch.cat([host(z) for z in (q, k, v)], -1)
    out["op:qkv_causal_conv1d_silu"] = [digest(conv[32]), digest(conv[64]),
                                        bool(torch.equal(conv[32], conv[64][:, :32]))]
    xn, gate = int_tensor(46, 2, 64, 64), int_tensor(47, 1, 64, 2 * 64)
    wn = dev(int_tensor(48, 64) + 1.0, ttnn.bfloat16)
    nrm = {t_len: host(ttnn.experimental.kda.sigmoid_gated_rms_norm(dev(xn[:, :t_len]), dev(gate[:, :t_len],
                                                                                             ttnn.bfloat16), wn, 2))
           for t_len in (32, 64)}
    out["op:sigmoid_gated_rms_norm"] = [digest(nrm[32]), digest(nrm[64]), bool(torch.equal(nrm[32], nrm[64][:, :32]))]
    # the flat chunk GDN kernel (1 key head, 2 value heads of 32) and the Path A scan: one chunk vs the same chunk first
    qf, kf, vf = int_tensor(50, 1, 64, 32), int_tensor(51, 1, 64, 32), int_tensor(52, 1, 64, 64)
    gf, bf = -int_tensor(53, 1, 64, 2).abs() * 8, int_tensor(54, 1, 64, 2).abs() * 4
    ch = {t_len: host(ttnn.transformer.chunk_gated_delta_rule(
        *(dev(z[:, :t_len], ttnn.bfloat16) for z in (qf, kf, vf)), dev(gf[:, :t_len]), dev(bf[:, :t_len]),
        chunk_size=32, output_head_major=True)[0]) for t_len in (32, 64)}
    out["op:chunk_gdn_flat"] = [digest(ch[32]), digest(ch[64]), bool(torch.equal(ch[32], ch[64][:, :32]))]
    sq = {n: int_tensor(60 + i, 1, 2, *shape, scale=2.0 ** -16)
          for i, (n, shape) in enumerate((("L_unit", (128, 128)), ("v", (128, 128)), ("k", (128, 128)),
                                           ("intra", (128, 128)), ("q", (128, 128)), ("kt", (128, 128)),
                                           ("L_inv", (128, 32))))}
    dl = torch.full((1, 2, 1, 1), 0.9375)
    seq = {nc: host(ttnn.transformer.gated_delta_attn_seq(
        *(dev(sq[n][:, :nc]) for n in ("L_unit", "v", "k", "intra", "q", "kt")), dev(dl[:, :nc]),
        dev(sq["L_inv"][:, :nc]))[0]) for nc in (1, 2)}
    out["op:gated_delta_attn_seq"] = [digest(seq[1]), digest(seq[2]), bool(torch.equal(seq[1], seq[2][:, :1]))]
    # the KDA preparation and chunk scan: one chunk vs the same chunk first of two
    pq, pk, pg = (int_tensor(70 + i, 1, 64, 64, scale=2.0 ** -13) for i in range(3))
    pv, pb = int_tensor(73, 1, 64, 64), int_tensor(74, 1, 64, 32)
    start = ttnn.from_torch(torch.tensor([0]), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    prep, scan = {}, {}
    for t_len in (32, 64):
        terms = ttnn.experimental.kda.prepare_chunk_recurrence(
            *(dev(z[:, :t_len], ttnn.bfloat16) for z in (pq, pk, pv, -pg.abs(), pb)), 2)
        prep[t_len] = torch.cat([host(x).reshape(2, t_len // 32, -1) for x in terms], -1)
        y, _ = ttnn.experimental.kda.recurrent_chunk_scan(*terms, dev(torch.zeros(2, 32, 32)), actual_start=start,
                                                          tail_entry_states=dev(torch.zeros(2, 32, 32)))
        scan[t_len] = host(y)
    out["op:kda_prepare_chunk_recurrence"] = [digest(prep[32]), digest(prep[64]),
                                              bool(torch.equal(prep[32], prep[64][:, :1]))]
    out["op:kda_recurrent_chunk_scan"] = [digest(scan[32]), digest(scan[64]), bool(torch.equal(scan[32], scan[64][:, :1]))]
    return out


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    return h.hexdigest()[:16]


def tiny_weight_fingerprints() -> dict:
    from ..tiny import PRESETS, random_weights

    return {f"tiny:random_weights:{preset}:{dt}": weights_digest(random_weights(PRESETS[preset], 0, getattr(torch, dt)))
            for preset in ("ci", "moe-ci") for dt in ("float32", "bfloat16")}


def model_fingerprints() -> dict:
    from ..checkpoint import load_checkpoint
    from ..speculative.engine import speculative_generate
    from ..generation.sampling import SamplingParams
    from ..tt.spec.build import build_spec_backend
    from ..tt.runtime.generator import SMALL_PAGES, build_generator
    from ..tt.spec.mtp_drafter import TTMTPDrafter
    from ..tt.spec.build import build_spec_backend

    ckpt = files("qwen36") / "default_checkpoint"
    reader = load_checkpoint(ckpt, require_mtp=True)
    gen = build_generator(ckpt, "emulated-p150x2", precision="performance", max_seq_len=128, progress=False,
                          pages=SMALL_PAGES, cache_dir=None, require_mtp=True)
    out = tiny_weight_fingerprints()
    try:
        prompt = PROMPTS[0]
        out["model:prefill_logits"] = digest(gen.prefill(prompt, all_rows=True))
        logits, tok, toks = [], None, []
        last = gen.prefill(prompt)
        tok = int(last.argmax())
        for _ in range(6):
            toks.append(tok)
            lg, tok = gen.decode_step(tok)
            logits.append(lg)
        gen.release_trace()
        out["model:decode_logits"] = digest(torch.stack(logits))
        out["model:decode_tokens"] = toks
        be = build_spec_backend(gen, TTMTPDrafter(reader), mechanism="snapshot")
        try:
            r = speculative_generate(be, [prompt], 12, [3])[0]
        finally:
            be.release()
        out["model:spec_tokens"] = r.tokens
        out["model:spec_accepted"] = list(r.stats.accepted)
        bb = build_spec_backend(gen, TTMTPDrafter(reader), users=2, depth=3, mechanism="shadow_commit")
        try:
            rs = speculative_generate(bb, PROMPTS, 8, [3, 3], [SamplingParams()] * 2)
        finally:
            bb.close()
        out["model:batch_tokens"] = [x.tokens for x in rs]
        out["model:batch_accepted"] = [list(x.stats.accepted) for x in rs]
    finally:
        gen.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--part", choices=("ops", "model", "all"), default="all")
    a = p.parse_args(argv)
    rec = {"torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if a.part in ("ops", "all"):
        rec.update(op_fingerprints())
    if a.part in ("model", "all"):
        rec.update(model_fingerprints())
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
