"""Recording the vllm-tt plugin's calls on the model class (dev runs through the real engine), in the JSON form the
CI replays read back (``restore``, ``replay_calls``): tensors as {"shape", "dtype", "values"}, numpy arrays
with "ndarray", the plugin's TTSamplingParams as {"dataclass", "fields"}."""
from __future__ import annotations

import dataclasses
import inspect

# the serving methods the plugin calls on the model class
RECORDED = ("prefill_forward", "decode_forward", "process_decode_output_host", "read_decode_output",
            "allocate_kv_cache_per_layer", "allocate_kv_cache", "warmup_model_prefill", "warmup_model_decode",
            "release_request", "note_state_slots_moved")


def summarize(x):
    """A call argument as JSON (every value: the replay feeds them back)."""
    import numpy as np
    import torch

    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # the plugin's TTSamplingParams
        return {"dataclass": type(x).__name__, "fields": {f.name: summarize(getattr(x, f.name))
                                                          for f in dataclasses.fields(x)}}
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", ""), "values": x.tolist()}
    if isinstance(x, np.ndarray):
        return {"ndarray": True, "shape": list(x.shape), "dtype": str(x.dtype), "values": x.tolist()}
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, torch.Tensor) for v in x):
        return [summarize(v) for v in x]
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (list, tuple)) and all(isinstance(v, (bool, int, float)) or v is None for v in x):
        return list(x)
    return {"type": type(x).__name__}


def record_calls(cls, calls: list, setattr_=setattr, instances: list | None = None,
                 rows: dict | None = None) -> None:
    """Wrap ``cls``'s serving methods so every call appends {"call", "args"} to ``calls`` (a prefill also gets
    "returned": shape, dtype and the tokens the runner reads). ``setattr_`` installs the wrapper (pytest's
    ``monkeypatch.setattr`` undoes it after the test); ``instances`` receives each model object once; ``rows``
    (call index -> fp32 [B, V]) keeps the last-position logits a prefill returned (not the recording's: too big)."""
    for name in RECORDED:
        fn = getattr(cls, name)
        sig = inspect.signature(fn)

        def wrap(self, *a, __fn=fn, __sig=sig, __name=name, **k):
            if instances is not None and not any(i is self for i in instances):
                instances.append(self)
            bound = __sig.bind(self, *a, **k)
            args = {key: summarize(v) for key, v in bound.arguments.items()
                    if key not in ("self", "kv_cache", "kwargs")}
            args.update({key: summarize(v) for key, v in bound.arguments.get("kwargs", {}).items()})
            if __name == "allocate_kv_cache_per_layer":
                args = {"per_layer_specs": [[list(s[0]), str(s[1]), s[2]] for s in a[0]]}
            calls.append({"call": __name, "args": args})
            out = __fn(self, *a, **k)
            if __name == "prefill_forward":  # what the runner reads: [B, 1, V] logits or [B, 1] ids (+ rope deltas)
                lg = out[0] if isinstance(out, tuple) else out
                toks = lg[:, -1].argmax(-1) if lg.dim() == 3 else lg[:, -1]
                calls[-1]["returned"] = {"shape": list(lg.shape), "dtype": str(lg.dtype).replace("torch.", ""),
                                         "tokens": toks.tolist()}
                if rows is not None and lg.dim() == 3:
                    rows[len(calls) - 1] = lg[:, -1].float().clone()
            return out

        setattr_(cls, name, wrap)


def load_trace(path) -> dict:
    """A recording (tests/data/vllm_tt_plugin_*_trace.json, or .json.gz for the large ones)."""
    import gzip
    import json
    from pathlib import Path

    path = Path(path)
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


def restore(v):
    """A recorded argument back into what the runner passed (the inverse of ``summarize``): torch tensors, numpy
    arrays, the adapter's TTSamplingParams, plain values."""
    import numpy as np
    import torch

    from ..tt.serving import vllm_types as vt

    if isinstance(v, dict) and v.get("dataclass") == "TTSamplingParams":
        return vt.TTSamplingParams(**{k: restore(x) for k, x in v["fields"].items()})
    if isinstance(v, dict) and "values" in v:
        if v.get("ndarray"):
            return np.array(v["values"], dtype=v["dtype"]).reshape(v["shape"])
        return torch.tensor(v["values"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
    if isinstance(v, list):
        return [restore(x) for x in v]
    return v


def feed_calls(m, calls: list[dict], kv=None):
    """Feed recorded ``calls`` to the model ``m`` in order, with their recorded arguments; yields (index, call record,
    restored arguments, return value) per call. ``allocate_kv_cache_per_layer`` allocates the KV pool that later calls
    get as ``kv_cache`` (its return value is the pool); ``release_request`` takes no pool; ``kv``: a pool allocated
    by calls fed earlier."""
    import torch

    for i, c in enumerate(calls):
        name, args = c["call"], {k: restore(v) for k, v in c["args"].items()}
        if name == "allocate_kv_cache_per_layer":
            specs = [(tuple(s), getattr(torch, d.replace("torch.", "")), i) for s, d, i in c["args"]["per_layer_specs"]]
            out = kv = m.allocate_kv_cache_per_layer(specs)
        elif name == "release_request":
            out = m.release_request(**args)
        else:
            out = getattr(m, name)(kv_cache=kv, **args)
        yield i, c, args, out


def replay_calls(m, trace: dict) -> list[list[tuple]]:
    """Feed ``trace``'s calls to the model ``m`` with their recorded arguments; every prefill's return must have the
    recorded shape, dtype and tokens (argmax of the logits, or the device-sampled ids). Returns per request the
    (token, logits row or None) of every step, in emission order."""
    prompts = trace["prompts"]
    got = [[] for _ in prompts]
    for _, c, args, out in feed_calls(m, trace["calls"]):
        if c["call"] != "prefill_forward":
            continue
        res = out[0] if isinstance(out, tuple) else out
        want = c["returned"]
        assert list(res.shape) == want["shape"] and str(res.dtype) == f"torch.{want['dtype']}"
        toks = (res[:, -1].argmax(-1) if res.dim() == 3 else res[:, -1]).tolist()
        assert toks == want["tokens"]
        tokens, lens = args["tokens"], args["prompt_lens"]
        for i in range(tokens.shape[0]):
            user = next(u for u, p in enumerate(prompts) if tokens[i, : len(p)].tolist() == p)
            assert int(lens[i]) == len(prompts[user]) + len(got[user])  # the row is this request's next step
            got[user].append((toks[i], res[i, -1].clone() if res.dim() == 3 else None))
    return got


def record_into(folder, cls, rows: bool = False, status=None) -> None:
    """A dev server's recorder (``vllm serve`` launched in-process, its engine core forked from the launcher): wrap
    ``cls``'s serving methods (``record_calls``) and, from the engine core's first ``initialize_vllm_model`` on, write
    every second into ``folder``: ``calls.jsonl`` (each call once complete), ``model_args.json`` (the loaded model's
    prefill chunk, KV block size and max sequence length, which a replay needs), with ``rows`` the last-position
    logits of each prefill (``rows/<call index>.pt``), and one ``status.jsonl`` line per second ({"t", "calls"} plus
    ``status(models)``). Call it in the launcher before vLLM starts."""
    import json
    import threading
    import time
    from pathlib import Path

    import torch

    folder = Path(folder)
    calls: list = []
    models: list = []
    kept: dict | None = {} if rows else None
    record_calls(cls, calls, instances=models, rows=kept)

    def complete(c: dict, last: bool) -> bool:
        return not last or c["call"] != "prefill_forward" or "returned" in c

    def flush_forever():
        (folder / "rows").mkdir(parents=True, exist_ok=True)
        done, done_rows = 0, set()
        with open(folder / "calls.jsonl", "a") as cf, open(folder / "status.jsonl", "a") as sf:
            while True:
                n = len(calls)
                while done < n and complete(calls[done], done == n - 1):
                    cf.write(json.dumps(calls[done]) + "\n")
                    done += 1
                cf.flush()
                for k in [k for k in list(kept or {}) if k not in done_rows]:
                    torch.save(kept[k], folder / "rows" / f"{k}.pt")
                    done_rows.add(k)
                if models and not (folder / "model_args.json").exists():
                    a = models[0].model.args
                    (folder / "model_args.json").write_text(json.dumps(
                        {f: getattr(a, f) for f in ("prefill_chunk", "block_size", "max_seq_len")}))
                sf.write(json.dumps(dict(t=round(time.time(), 2), calls=done, **(status(models) if status else {})))
                         + "\n")
                sf.flush()
                time.sleep(1.0)

    init = cls.initialize_vllm_model.__func__
    started: list = []

    def initialize_vllm_model(klass, *a, **k):  # in the engine core: the recorder's thread lives there
        if not started:
            started.append(threading.Thread(target=flush_forever, daemon=True))
            started[0].start()
        return init(klass, *a, **k)

    cls.initialize_vllm_model = classmethod(initialize_vllm_model)


def read_recording(folder, after: int = 0) -> list[dict]:
    """The calls a ``record_into`` folder holds, from call index ``after`` on."""
    import json
    from pathlib import Path

    path = Path(folder) / "calls.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines[after:]]
