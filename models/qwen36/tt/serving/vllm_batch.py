"""Plain decode of 1..32 vLLM sequences on one :class:`BucketedBatchDecoder` (the vllm-tt adapter's server for every
launch without speculation, ``max_num_seqs`` 1 included as bucket 1; logits to vLLM's host sampler, or ids sampled
on device with ``sample_on_device_mode``)."""
from __future__ import annotations

import secrets

import torch

from ...generation.sampling import SamplingParams, TokenHistory, pick_token
from ..runtime.batch import DEFAULT_BUCKETS, FREE
from ..runtime.batch_buckets import BucketedBatchDecoder
from ..model.state import KVLayerState
from .vllm_args import BlockTables, DecodeHandle, sampling_from_plugin


class BatchServer:
    """The vLLM sequences of a plain launch (1..32) on one :class:`BucketedBatchDecoder` (logits to vLLM's host
    sampler, or ids sampled on device).

    vLLM state slot j is decoder slot j. The plugin names each prefilling row's slot (``empty_slots``) and, before
    a decode call, the permutation that takes every request's state to its row (``slot_remap``, applied on
    device). Its synchronous runner sends every decode step as a one-token prefill continuation
    (``prefill_forward(tokens[:, :n+1], start_pos=[n], prompt_lens=[n+1])``: ``_prepare_model_inputs`` counts a
    request as still prefilling while ``num_computed_tokens < num_tokens``, which holds again once a step's token is
    applied to its input batch); a continuation row names no source slot, only a
    destination, so the source is the slot whose fed tokens are the row's ``tokens[:start_pos]`` (two slots with
    the same tokens hold the same state), and the continuing states are moved to their destinations by one
    on-device permutation before the step. The plugin does not tell a model when a request finishes (a finished
    request's slot is simply named again by a later prefill), so a prefill into a held slot replaces it, and until
    then a finished request's slot counts as held (the decoder shrinks to a smaller bucket only below that).

    Dependencies: ``model`` (the TT model the decoder runs), ``blocks`` (vLLM's block tables against the KV pool)."""

    def __init__(self, model, slots: int, blocks: BlockTables, *, uses_mrope: bool = False):
        self.model, self.blocks, self.uses_mrope = model, blocks, uses_mrope
        # the decode buckets below max_num_seqs, and max_num_seqs itself: a step runs the smallest that holds the
        # live sequences (the runner pads every decode to max_num_seqs rows; the padding costs nothing here)
        buckets = tuple(b for b in DEFAULT_BUCKETS if b < slots) + (slots,)
        self.dec = BucketedBatchDecoder(model, buckets, use_trace=True, sampling=True)
        self.fed: list[list[int] | None] = [None] * slots  # tokens whose state each slot holds (None: free)
        # per slot: prompt length, the request's seed if it carries none (drawn at its prefill), the params its device
        # sampler row holds (None: never sampled on device), the token the device sampled last (None: the last token
        # came from vLLM's host sampler, so the penalty row must be rewritten before the next device step)
        self.meta: list[dict | None] = [None] * slots

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _page_rows(self, page_table, slots: dict[int, int], tokens: dict[int, int] | None = None) -> None:
        """Row i of vLLM's block table -> decoder slot ``slots[i]``'s page-table row, for the rows in ``slots`` (the
        rows that carry a sequence in this call; the other slots keep theirs). With ``tokens`` (row -> tokens the
        sequence holds after this call), entries past the blocks those tokens cover become the null block 0: the
        runner does not clear a row's tail when another request takes the row, so it can still name a block a
        live request owns, and a prefill zeroes every page of its row before writing."""
        if page_table is None:
            return
        pt = torch.as_tensor(page_table)
        if pt.dim() != 2 or pt.shape[0] <= max(slots, default=-1):
            raise ValueError(f"page_table must be [B > {max(slots, default=-1)}, max_blocks], got shape "
                             f"{tuple(pt.shape)}")
        table = self.dec.page_table_host
        for i, slot in slots.items():
            table[slot] = self.blocks.row(pt, i, None if tokens is None else tokens[i])
        self.dec.set_page_table(table)

    @property
    def slots(self) -> int:
        return self.dec.slots

    @property
    def kv_state(self):
        """The state whose full-attention layers every bucket reads and writes (the largest bucket's): the caches
        vLLM's pool replaces (``Qwen36ForCausalLM.allocate_kv_cache*``)."""
        return self.dec.decs[self.dec.slots].state

    def on_kv_pool(self, num_blocks: int) -> None:
        """vLLM's pool replaced the caches of ``kv_state`` (the model class's ``state``): every bucket reads and
        writes it."""
        for i, layer in enumerate(self.kv_state.layers):
            if isinstance(layer, KVLayerState):
                self.dec.replace_kv(i, layer)
        self.fit_page_tables(num_blocks)

    def release_traces(self) -> None:
        self.dec.release()

    def check_remap(self, remap) -> None:
        """Any permutation is served (decode applies it on device)."""

    def check_moved(self, moved: dict) -> None:
        if moved:
            raise NotImplementedError(f"state slots moved {moved} outside a decode call: this model moves state "
                                      f"with decode_forward's slot_remap (a permutation applied on device)")

    def fit_page_tables(self, num_blocks: int) -> None:
        """After vLLM's pool replaced the model's own cache: every page-table row no request has set yet (the
        decoder's default rows, in every bucket) names blocks of that pool. A padded row of a step still reads its
        row's pages (its output is discarded), so a block id past a small pool would read outside it (the emulator
        refuses it; on cards it reads whatever lies there). Ids wrap into 1..num_blocks-1, never the null block."""
        def fit(t: torch.Tensor) -> torch.Tensor:
            return torch.where(t >= num_blocks, 1 + t % (num_blocks - 1), t).to(torch.int32)

        for d in self.dec.decs.values():
            d.set_page_table(fit(d.state.page_table_host))
        self.dec.set_page_table(fit(self.dec.page_table_host))

    def _remap(self, remap: list[int]) -> None:
        self.dec.slot_remap(remap)  # validates; identity does nothing
        self.fed = [self.fed[j] for j in remap]
        self.meta = [self.meta[j] for j in remap]

    def _free(self, slot: int) -> None:
        if self.dec.pos[slot] != FREE:
            self.dec.leave(slot)
        self.fed[slot], self.meta[slot] = None, None

    def _row_params(self, sampling_params, row: int, slot: int) -> SamplingParams:
        vocab = self.model.args.cfg.vocab_size
        params = sampling_from_plugin(sampling_params, vocab, self.meta[slot]["seed"], row=row)
        held = self.meta[slot]["params"]
        if held is not None and params != held:
            raise ValueError(f"sampling_params row {row} changed within one sequence ({held.describe()} -> "
                             f"{params.describe()}): a new request starts with a prefill")
        return params

    def _device_tokens(self, sampling_params, feed: dict[int, tuple[int, int]]) -> dict[int, int]:
        """One device-sampled step: ``feed`` = {slot: (row, token)}; each slot's sampler row is (re)started or
        resynced first when its last token did not come from it."""
        for slot, (row, tok) in feed.items():
            m = self.meta[slot]
            params = self._row_params(sampling_params, row, slot)
            history = self.fed[slot] + [tok]
            if m["params"] is None:  # first device step of this sequence: its prompt and emitted tokens so far
                self.dec.start_sampling(slot, params, history[: m["prompt_len"]], history[m["prompt_len"]])
                self.dec.resync_sampling(slot, m["prompt_len"], history)
                m["params"] = params
            elif m["last"] is None:  # the last token came from vLLM's host sampler: rebuild the penalty row
                self.dec.resync_sampling(slot, m["prompt_len"], history)
            elif m["last"] != tok:  # the plugin feeds back the id the device returned (never another)
                raise ValueError(f"row {row}: decode input token {tok} != the token this model sampled last "
                                 f"({m['last']})")
        got = self.dec.sample_step({slot: tok for slot, (_, tok) in feed.items()})
        for slot, t in got.items():
            self.meta[slot]["last"] = t
        return got

    def _logits_out(self, rows: int, got: dict[int, torch.Tensor], read: bool = True):
        vocab = self.model.args.cfg.vocab_size
        out = torch.zeros(rows, 1, vocab, dtype=torch.float32)  # rows not served: zeros, never read
        for i, lg in got.items():
            out[i, 0] = lg
        return out

    # ---- the plugin's calls ----------------------------------------------------------------------------------
    def prefill(self, tokens, lens, start_pos, page_table, empty_slots, sampling_params, enable_trace: bool):
        rows = tokens.shape[0]
        starts = (torch.zeros(rows, dtype=torch.int64) if start_pos is None
                  else torch.as_tensor(start_pos).reshape(-1).to(torch.int64))
        slots = list(range(rows)) if empty_slots is None else [int(x) for x in empty_slots]
        if starts.numel() != rows or len(slots) != rows:
            raise ValueError(f"prefill of {rows} rows with start_pos {starts.tolist()} and empty_slots {slots}")
        if len(set(slots)) != rows or any(not 0 <= x < self.dec.slots for x in slots):
            raise ValueError(f"empty_slots {slots}: distinct slots in [0, {self.dec.slots}) expected")
        new, cont = [], {}  # rows prefilled from position 0; row -> source slot of a one-token continuation
        taken: set[int] = set()
        for i in range(rows):
            start, end = int(starts[i]), int(lens[i])
            if start == 0:
                new.append(i)
                continue
            if end != start + 1:
                raise NotImplementedError(f"prefill row {i}: start_pos={start}, prompt_lens={end}: a prefill continues "
                                          f"no cached prefix here (run vLLM without prefix caching / chunked prefill); "
                                          f"only the one-token continuation of a live sequence is served")
            seq = tokens[i, :start].tolist()
            src = next((j for j in range(self.dec.slots) if j not in taken and self.fed[j] == seq), None)
            if src is None:
                raise ValueError(f"prefill row {i} continues a sequence of {start} tokens that no state slot holds")
            taken.add(src)
            cont[i] = src
        # one permutation moves every continuing state to its destination slot (sources of nothing stay put when
        # they can); a new prompt's destination then receives whatever was left there and is overwritten
        dest = {slots[i]: src for i, src in cont.items()}
        remap = [dest.get(t) for t in range(self.dec.slots)]
        spare = [j for j in range(self.dec.slots) if j not in taken]
        for t in range(self.dec.slots):
            if remap[t] is None and t in spare:
                remap[t] = t
                spare.remove(t)
        for t in range(self.dec.slots):
            if remap[t] is None:
                remap[t] = spare.pop(0)
        self._remap(remap)
        self._page_rows(page_table, dict(enumerate(slots)), {i: int(lens[i]) for i in range(rows)})
        got, ids = {}, {}
        vocab = self.model.args.cfg.vocab_size
        for i in new:
            slot, prompt = slots[i], tokens[i, : int(lens[i])].tolist()
            self._free(slot)  # a finished request's slot named again: the plugin never said it finished
            got[i] = self.dec.join(slot, prompt)
            self.fed[slot] = prompt
            self.meta[slot] = {"prompt_len": len(prompt), "seed": secrets.randbits(31), "params": None, "last": None}
            if sampling_params is not None:  # the first token from the prompt's last row, on the host
                params = self._row_params(sampling_params, i, slot)
                gen = params.generator() if not params.greedy else None
                ids[i] = int(pick_token(got[i].reshape(1, -1), params, gen, TokenHistory(prompt, vocab).now()))
                self.dec.start_sampling(slot, params, prompt, ids[i])
                self.meta[slot].update(params=params, last=ids[i])
        if cont:
            feed = {}
            for i in cont:
                slot, start = slots[i], int(starts[i])
                if self.dec.pos[slot] != start:
                    raise RuntimeError(f"slot {slot} is at position {self.dec.pos[slot]}, row {i} continues at {start}")
                feed[slot] = int(tokens[i, start])
            if sampling_params is not None:
                picked = self._device_tokens(sampling_params, {slots[i]: (i, feed[slots[i]]) for i in cont})
                ids.update({i: picked[slots[i]] for i in cont})
            else:
                logits, _ = self.dec.step(feed)
                for i in cont:
                    got[i] = logits[slots[i]]
                    self.meta[slots[i]]["last"] = None  # vLLM samples this step's token on the host
            for i in cont:
                self.fed[slots[i]].append(feed[slots[i]])
        if sampling_params is not None:
            out = torch.zeros(rows, 1, dtype=torch.int32)
            for i, t in ids.items():
                out[i, 0] = t
        else:
            out = self._logits_out(rows, got)
        if self.uses_mrope:
            return out, torch.zeros(rows, dtype=torch.int64)
        return out

    def decode(self, tokens, pos, page_table, enable_trace: bool, read_from_device: bool, sampling_params,
               num_valid_drafts, accepted_counts, spec_mode, extra: dict):
        if spec_mode is not None or num_valid_drafts is not None or accepted_counts is not None:
            raise NotImplementedError(f"a speculative step in a plain launch ({self.dec.slots} sequence(s), loaded "
                                      f"without num_speculative_tokens): speculation needs a speculative_config and "
                                      f"--max-num-seqs 1")
        slot_remap = extra.get("slot_remap")
        if tokens.shape[1] != 1:
            raise ValueError(f"plain decode takes tokens [B, 1], got {tuple(tokens.shape)}")
        rows = tokens.shape[0]
        if rows > self.dec.slots:
            raise ValueError(f"decode of {rows} rows, this model holds {self.dec.slots} sequence(s) (the runner pads "
                             f"a decode to max_num_seqs rows)")
        if slot_remap is not None:  # row i reads (and from now on owns) the state of slot remap[i]
            self._remap([int(x) for x in torch.as_tensor(slot_remap).reshape(-1).tolist()])
        p = pos.reshape(-1)
        live = [i for i in range(rows) if int(p[i]) >= 0]
        for i in live:
            if self.dec.pos[i] != int(p[i]):
                raise ValueError(f"decode row {i} at position {int(p[i])}, but state slot {i} holds "
                                 f"{'no sequence' if self.dec.pos[i] == FREE else f'one at {self.dec.pos[i]}'}")
        self._page_rows(page_table, {i: i for i in live}, {i: int(p[i]) + 1 for i in live})
        self.dec.use_trace = bool(enable_trace)
        feed = {i: int(tokens[i, 0]) for i in live}
        if sampling_params is not None:  # async_decode.submit_decode: ids sampled on device, [B, 1] int32
            self._check_history(extra.get("prompt_tokens"), extra.get("output_tokens"), feed)
            got = self._device_tokens(sampling_params, {i: (i, t) for i, t in feed.items()})
            for i in live:
                self.fed[i].append(feed[i])
            ids = torch.zeros(rows, 1, dtype=torch.int32)  # padding rows: token 0, never read
            for i, t in got.items():
                ids[i, 0] = t
            return ids if read_from_device else DecodeHandle(tokens=ids)
        logits, _ = self.dec.step(feed)
        for i in live:
            self.fed[i].append(feed[i])
            self.meta[i]["last"] = None  # vLLM samples this step's token on the host
        out = self._logits_out(rows, {i: logits[i] for i in live})
        return out if read_from_device else DecodeHandle(out)

    def _check_history(self, prompt_tokens, output_tokens, feed: dict[int, int]) -> None:
        """The runner's token history (``prompt_tokens`` / ``output_tokens``, [B, L] -1 padded, sent with device
        sampling when a penalty is on) must be the sequence each row's device penalty state is built from: its
        prompt, then every token emitted since (this step's input the last)."""
        if prompt_tokens is None and output_tokens is None:
            return
        pts, ots = torch.as_tensor(prompt_tokens), torch.as_tensor(output_tokens)
        for i, tok in feed.items():
            n = self.meta[i]["prompt_len"]
            pt = [int(t) for t in pts[i].tolist() if int(t) != -1]
            ot = [int(t) for t in ots[i].tolist() if int(t) != -1]
            if pt != self.fed[i][:n] or ot != self.fed[i][n:] + [tok]:
                raise ValueError(f"row {i}: the runner's token history (prompt {len(pt)} tokens, output {len(ot)}) "
                                 f"differs from the sequence the device penalty state holds (prompt {n}, output "
                                 f"{len(self.fed[i]) + 1 - n}): a request resumed after preemption re-prefills its "
                                 f"output as prompt, which the penalty state cannot tell apart")

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.dec.slots:
            raise ValueError(f"release_request(slot={slot}): state slots are 0..{self.dec.slots - 1}")
        self._free(slot)

    # ---- warmup ----------------------------------------------------------------------------------------------
    def _warm_table(self) -> None:
        self._page_rows(self.blocks.warm().expand(self.dec.slots, -1), {i: i for i in range(self.dec.slots)})

    def warmup_prefill(self, lens: list[int]) -> None:
        self._warm_table()
        vocab = self.model.args.cfg.vocab_size
        for n in lens:
            self._free(0)
            self.dec.join(0, [i % vocab for i in range(1, n + 1)])
        self._free(0)

    def warmup_decode(self, steps: int, enable_trace: bool, sampled: bool = False) -> None:
        """Compile (and with ``enable_trace`` capture and replay) the B-slot step: one user in slot 0, every other
        row padded (the same program whichever rows are live); with ``sampled`` also the device-sampled step."""
        self._warm_table()
        self._free(0)
        self.dec.warm()
        tok = int(self.dec.join(0, [1, 2]).argmax())
        self.dec.use_trace = enable_trace
        for _ in range(steps):
            _, ids = self.dec.step({0: tok})
            tok = int(ids[0])
        if sampled:
            self.dec.start_sampling(0, SamplingParams(temperature=1.0, top_k=8, top_p=0.9, repetition_penalty=1.1,
                                                      seed=0), [1, 2], tok)
            for _ in range(steps):
                tok = self.dec.sample_step({0: tok})[0]
        self._free(0)