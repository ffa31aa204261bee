"""Replay every recorded vllm-tt engine trace (tests/data/vllm_tt_plugin_*_trace.json) through the model class on
the emulated mesh and save what each call returned, plus the emulator's memory accounting after load and after
vLLM's KV pool is allocated, so that two trees can be compared call for call (``--compare A.pt B.pt``: every
returned tensor bitwise, then the memory figures).

    python scripts/vllm_replay_outputs.py OUT.pt            # run with the tree (and venv) to record
    python scripts/vllm_replay_outputs.py --compare OLD.pt NEW.pt
    python scripts/vllm_replay_outputs.py --unused-cost     # what a plain launch's generator + spec backend took

Uses only what the recorded traces and the class's plugin-facing calls use, so that an older tree runs it too.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
# trace file -> how the recorded engine run loaded the class (max_num_seqs from the trace)
TRACES = ("vllm_tt_plugin_batch_trace.json", "vllm_tt_plugin_batch_sampled_trace.json",
          "vllm_tt_plugin_soak_trace.json")


def host_bytes() -> int:
    """Host bytes held by live emulated device tensors (the emulator keeps each device's shard as a torch tensor)."""
    gc.collect()
    total = 0
    for o in gc.get_objects():
        if type(o).__name__ == "EmuTensor" and not getattr(o, "_deallocated", False):
            total += sum(s.element_size() * s.numel() for s in getattr(o, "_shards", ()))
    return total


def plain(x):
    """A returned value as host tensors (a DecodeHandle as the host copy the plugin reads)."""
    from qwen36.tt.serving.vllm_args import DecodeHandle

    if isinstance(x, DecodeHandle):
        return {"handle": plain(x.host)}
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return [plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if hasattr(x, "__dict__"):  # VerifyOutput / DraftOutput-like records
        return {k: plain(v) for k, v in vars(x).items()}
    return repr(x)


def record(out: Path) -> None:
    from qwen36.testing.tt import make_bf16_checkpoint
    from qwen36.testing.vllm_calls import feed_calls
    from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION
    from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
    from qwen36.tt_ops.device import open_mesh

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        ck = make_bf16_checkpoint(Path(tmp) / "ci", "ci")
        hf = json.loads((ck / "config.json").read_text())
        for name in TRACES:
            trace = json.loads((DATA / name).read_text())
            ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
            base_dram, base_host = ctx.mesh_device.dram_in_use(), host_bytes()
            m = Qwen36ForCausalLM.initialize_vllm_model(hf, ctx.mesh_device, trace["max_num_seqs"],
                                                        max_seq_len=trace["max_model_len"], tt_data_parallel=1,
                                                        checkpoint=ck, optimizations="accuracy")
            mem = {"load": ([d - b for d, b in zip(ctx.mesh_device.dram_in_use(), base_dram)],
                            host_bytes() - base_host)}
            outs = []
            for _, c, _, ret in feed_calls(m, trace["calls"]):
                call = c["call"]
                if call == "allocate_kv_cache_per_layer":
                    mem["kv_pool"] = ([d - b for d, b in zip(ctx.mesh_device.dram_in_use(), base_dram)],
                                      host_bytes() - base_host)
                    outs.append((call, None))  # the pool itself: device buffers, not a value the runner reads
                    continue
                outs.append((call, plain(ret)))
            m.release_persistent_capture()
            m.close()
            ctx.close()
            result[name] = {"outputs": outs, "memory": mem, "max_num_seqs": trace["max_num_seqs"]}
            print(f"{name}: {len(outs)} calls; memory {mem}", flush=True)
    torch.save(result, out)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def compare(old: Path, new: Path) -> int:
    a, b = torch.load(old, weights_only=False), torch.load(new, weights_only=False)
    bad = 0
    for name in TRACES:
        oa, ob = a[name]["outputs"], b[name]["outputs"]
        n_tensors = sum(1 for _, o in oa if isinstance(o, torch.Tensor) or isinstance(o, (list, dict)))
        diff = [i for i, (x, y) in enumerate(zip(oa, ob)) if x[0] != y[0] or not same(x[1], y[1])]
        bad += len(diff) + (len(oa) != len(ob))
        print(f"{name} (max_num_seqs {a[name]['max_num_seqs']}): {len(oa)} vs {len(ob)} calls, "
              f"{n_tensors} returns with tensors, {len(diff)} differ{(' at ' + str(diff[:5])) if diff else ''}")
        for stage in ("load", "kv_pool"):
            (da, ha), (db, hb) = a[name]["memory"][stage], b[name]["memory"][stage]
            print(f"  after {stage}: DRAM per device {da} -> {db} B (saved {[x - y for x, y in zip(da, db)]} B); "
                  f"emulator host {ha} -> {hb} B (saved {ha - hb} B)")
    return 1 if bad else 0


def unused_cost() -> None:
    """DRAM (per device) and emulator host bytes of what a plain launch used to build and never used: a one-sequence
    TTGenerator (its KV + GDN state and decode inputs) and, with an MTP head, the speculative backend with its MTP
    drafter (built here on a plain launch's weights, as the class built them, and measured as they allocate)."""
    from qwen36.checkpoint import load_checkpoint
    from qwen36.testing.tt import make_bf16_checkpoint
    from qwen36.tt.model.state import allocate_state
    from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION, TTGenerator
    from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
    from qwen36.tt.spec.build import build_spec_backend
    from qwen36.tt_ops.device import open_mesh

    with tempfile.TemporaryDirectory() as tmp:
        ck = make_bf16_checkpoint(Path(tmp) / "ci", "ci")
        hf = json.loads((ck / "config.json").read_text())
        for name in TRACES:
            trace = json.loads((DATA / name).read_text())
            ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
            m = Qwen36ForCausalLM.initialize_vllm_model(hf, ctx.mesh_device, trace["max_num_seqs"],
                                                        max_seq_len=trace["max_model_len"], tt_data_parallel=1,
                                                        checkpoint=ck, optimizations="accuracy")
            assert m.gen is None and m.spec_backend is None
            a = m.model.args
            d0, h0 = ctx.mesh_device.dram_in_use(), host_bytes()
            gen = TTGenerator(m.model, allocate_state(a, m.model.ttnn, m.model.mesh), use_trace=True)
            d1, h1 = ctx.mesh_device.dram_in_use(), host_bytes()
            be = build_spec_backend(gen, TTMTPDrafter(load_checkpoint(ck)), capped_accept=True)
            d2, h2 = ctx.mesh_device.dram_in_use(), host_bytes()
            print(f"{name} (max_seq_len {trace['max_model_len']}, block {a.block_size}): TTGenerator state + inputs "
                  f"DRAM {[y - x for x, y in zip(d0, d1)]} B per device, emulator host {h1 - h0} B; spec backend + MTP "
                  f"drafter at construction DRAM {[y - x for x, y in zip(d1, d2)]} B, host {h2 - h1} B", flush=True)
            be.close()
            m.close()
            ctx.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", type=Path)
    p.add_argument("--compare", action="store_true")
    p.add_argument("--unused-cost", action="store_true")
    args = p.parse_args(argv)
    if args.unused_cost:
        unused_cost()
        return 0
    if args.compare:
        return compare(*args.paths)
    record(args.paths[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
