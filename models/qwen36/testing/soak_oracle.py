"""The soak's resume-aware batch-1 oracle (scripts/soak_vllm.py, tests/tt/serving/test_vllm_soak_replay.py).

vLLM resumes a preempted request as a prefill from position 0 of its prompt plus the tokens it generated, so after
a resume its state comes from a prefill, not from the decode steps that built it the first time: the rows differ in
the last bits from an uninterrupted run's, and a near tie can flip. The oracle therefore compares each request with
the batch-1 run that does the same thing: prefill each segment the engine prefilled (the prompt, and at every resume
the prompt + the tokens generated so far), decode the rest of the segment one token at a time. Then

- every logits row the engine returned is compared with the batch-1 row for the same tokens (max abs, PCC);
- a greedy request must emit the argmax of each batch-1 row (by induction the batch-1 greedy run with the same
  resumes);
- a seeded sampled request must emit what vLLM's own ``Sampler`` picks from the batch-1 rows with the request's
  generator advanced as the plugin advances it (one ``torch.rand(1)`` per step in ``advance_generators``, then the
  sampler's draw), which is the same seeded stream the engine used: the generator lives with the request and
  survives its preemption.
"""
from __future__ import annotations

import torch


def oracle_generator(ck, engine_args, device: str = "emulated-p150x2", precision: str = "accuracy"):
    """The batch-1 ``TTGenerator`` the oracle runs on: its own mesh, with the engine model's ``max_seq_len``,
    ``block_size`` and ``prefill_chunk`` (``engine_args``: the adapter's ``TTModelArgs``, or a dict of those three). A
    prompt prefilled in other chunks rounds differently (a 100-token prompt of the CI checkpoint: 0.023 max abs between
    chunks of 64 and one chunk of 256), so the oracle must prefill as the engine does."""
    from ..tt.runtime.generator import build_generator

    get = engine_args.get if isinstance(engine_args, dict) else lambda f: getattr(engine_args, f)
    return build_generator(ck, device, precision=precision, cache_dir=None, max_seq_len=get("max_seq_len"),
                          block_size=get("block_size"), prefill_chunk=get("prefill_chunk"))


def request_rows(calls: list[dict], rows: dict[int, torch.Tensor], prompts: list[list[int]],
                 outputs: list[list[int]]) -> list[list[tuple[int, bool, torch.Tensor]]]:
    """Per request, in order, (n fed, segment start, engine logits row predicting output token n - len(prompt), call
    index, row in the call, rows in the call) of every row the engine's ``prefill_forward`` calls returned. ``rows[i]`` holds call i's last-position logits
    [B, V]. Every row must continue its request with the tokens the engine emitted."""
    from .vllm_calls import restore

    got: list[list] = [[] for _ in prompts]
    for ci, c in enumerate(calls):
        if c["call"] != "prefill_forward" or ci not in rows:
            continue
        tokens = restore(c["args"]["tokens"])
        lens = restore(c["args"]["prompt_lens"])
        starts = c["args"].get("start_pos")
        starts = restore(starts) if starts is not None else None
        for i in range(tokens.shape[0]):
            u = next((j for j, p in enumerate(prompts) if tokens[i, : len(p)].tolist() == p), None)
            if u is None:  # padding row
                continue
            n, p = int(lens[i]), len(prompts[u])
            if tokens[i, :n].tolist() != prompts[u] + outputs[u][: n - p]:
                raise AssertionError(f"request {u}: row {i} of call {ci} is not its prompt + emitted tokens")
            start = starts is None or int(starts[i]) == 0
            if not start and (not got[u] or got[u][-1][0] != n - 1):
                raise AssertionError(f"request {u}: call {ci} continues at {n} without the row before it")
            got[u].append((n, start, rows[ci][i].float().clone(), ci, i, int(tokens.shape[0])))
    return got


def batch1_rows(gen, prompt: list[int], out: list[int], entries) -> list[torch.Tensor]:
    """The batch-1 rows for ``entries`` (``request_rows``' list for one request) on ``gen`` (a ``TTGenerator``):
    a segment start is a prefill of the first n tokens of prompt + out, each other row one decode step."""
    seq = list(prompt) + list(out)
    rows = []
    for n, start, *_ in entries:
        if start:
            rows.append(gen.prefill(seq[:n]).float().reshape(-1).clone())
        else:
            lg, _ = gen.decode_step(seq[n - 1])
            rows.append(lg.float().reshape(-1).clone())
    return rows


def row_digest(row: torch.Tensor) -> list:
    """[sha256 of the fp32 row's bytes, argmax, max]: what a compact recording keeps of a logits row (the hash
    changes with any bit of the row; the argmax and max say how far a mismatch went)."""
    import hashlib

    r = row.detach().float().contiguous().cpu()
    return [hashlib.sha256(r.numpy().tobytes()).hexdigest(), int(r.argmax()), float(r.max())]


def pcc(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-300))


def seeded_samples(rows: list[torch.Tensor], sampling: dict) -> list[int]:
    """What vLLM's host ``Sampler`` (the plugin's ``host_sampler``) picks from ``rows`` for one seeded request:
    a generator seeded with the request's seed (``build_cached_request_state``), advanced by one ``torch.rand(1)``
    per step before the draw (``_build_host_generators`` -> ``advance_generators``), temperature, top-k, top-p."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler()
    g = torch.Generator(device="cpu")
    g.manual_seed(int(sampling["seed"]))
    k, p = int(sampling.get("top_k", 0)), float(sampling.get("top_p", 1.0))
    picked = []
    for row in rows:
        torch.rand(1, generator=g)
        md = SamplingMetadata(
            temperature=torch.tensor([float(sampling["temperature"])]), all_greedy=False, all_random=True,
            top_p=torch.tensor([p]) if p < 1.0 else None, top_k=torch.tensor([k]) if k > 0 else None,
            generators={0: g}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(1), presence_penalties=torch.zeros(1),
            repetition_penalties=torch.ones(1), output_token_ids=[[]], allowed_token_ids_mask=None,
            bad_words_token_ids={}, logitsprocs=LogitsProcessors())
        picked.append(int(sampler(row.reshape(1, -1).clone(), md).sampled_token_ids.reshape(-1)[0]))
    return picked


def check_request(gen, prompt, out, sampling, entries, sample_fn=seeded_samples) -> dict:
    """The resume-aware oracle for one request. Returns a dict: rows, resumes, worst max abs and min PCC over all
    rows and over the rows from a resume on, whether the tokens equal the oracle's, the first differing token and
    the batch-1 row's top-2 margin there. ``sample_fn`` None (no vLLM, CI): a sampled request's tokens are not
    checked (``tokens_equal`` None), only its rows."""
    want = batch1_rows(gen, prompt, out, entries)
    got = [e[2] for e in entries]
    diffs = [float((a - b).abs().max()) for a, b in zip(got, want)]
    pccs = [pcc(a, b) for a, b in zip(got, want)]
    first_resume = next((i for i, e in enumerate(entries) if e[1] and i > 0), None)
    emitted = out[: len(entries)]
    if [e[0] for e in entries] != list(range(len(prompt), len(prompt) + len(entries))):
        raise AssertionError("the rows do not predict consecutive tokens from the first")
    greedy = float(sampling.get("temperature", 0.0)) == 0.0
    oracle = [int(r.argmax()) for r in want] if greedy else sample_fn(want, sampling) if sample_fn else None
    d = None if oracle is None else next((i for i, (a, b) in enumerate(zip(emitted, oracle)) if a != b), None)
    res = dict(rows=len(entries), resumes=sum(e[1] for e in entries) - 1, max_abs=max(diffs, default=0.0),
               min_pcc=min(pccs, default=1.0), tokens_equal=None if oracle is None else d is None, first_diff=d,
               worst_row=int(max(range(len(diffs)), key=diffs.__getitem__)) if diffs else None)
    if diffs:
        w = entries[res["worst_row"]]
        res.update(worst_call=w[3], worst_call_row=w[4], worst_call_rows=w[5], worst_pcc=pccs[res["worst_row"]])
    if first_resume is not None:
        res.update(resume_row=first_resume, resume_max_abs=max(diffs[first_resume:]),
                   resume_min_pcc=min(pccs[first_resume:]))
    if d is not None:
        top = want[d].topk(2).values
        res["margin"] = float(top[0] - top[1])
    return res
