"""The sequence of a speculative vLLM launch (``max_num_seqs`` 1, a speculative K): its prefill and every decode
step as the engine's speculative step (``SpecBatch.step``: verify + on-device greedy acceptance + commit + the MTP's
next drafts) on a :class:`TTSpecBackend` built with ``capped_accept`` (vLLM's drafts, acceptance capped at its
``num_valid_drafts``). Plain launches, ``max_num_seqs`` 1 included, run on the batch server (:mod:`.vllm_batch`).
The sequence lives in GDN state slot 0; rows past the first are accepted only as the runner's padding rows
(position -1; ``num_valid_drafts`` 0, ``accepted_counts`` 1) and get inert outputs."""
from __future__ import annotations

import torch

from ...config import LINEAR, Qwen36Config
from ...speculative.depth import DepthPolicy, FixedDepth, cost_key
from ...speculative.engine import SpecBatch, SpecRequest
from . import vllm_types as vt
from .vllm_args import DEPTH_COSTS, ONE_USER, BlockTables, batch_rows, max_depth, sampling_from_plugin


def depth_controller(k_max: int, costs: str = DEPTH_COSTS):
    """The fitted draft-depth controller (``speculative/depth.py``) for steps of at most ``k_max`` drafts."""
    return DepthPolicy.load().controller(cost_key(costs), k_max=k_max)


def spec_bytes(cfg: Qwen36Config, depths, max_len: int) -> int:
    """Declared device bytes of one speculating sequence over the whole mesh (the plugin records, does not yet
    budget, this): the K+1 fp32 GDN recurrent-state candidate slots of the shadow commit for every depth the
    step may use (one ring per depth), plus the MTP head's own bf16 KV cache for ``max_len`` tokens. An
    estimate from the config, not a measurement."""
    n_gdn = sum(1 for t in cfg.layer_types if t == LINEAR)
    slots = sum(int(k) + 1 for k in depths)
    gdn = slots * n_gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    mtp_kv = cfg.mtp_num_hidden_layers * 2 * max_len * cfg.num_key_value_heads * cfg.head_dim * 2
    return int(gdn + mtp_kv)


class OneSequenceServer:
    """The live sequence of a speculative launch: its mode (None: no sequence, "new" after the prefill, "spec" once
    it steps), its engine request on ``batch`` (a :class:`SpecBatch` over ``spec_backend``) and, under
    ``spec_depth`` auto, its depth controller. A speculative launch declares no narrow decode
    (``supports_narrow_decode=False``), so the runner sends every decode step as a verify: a plain decode, a
    one-token prefill continuation or a device-sampled step is refused here.

    Dependencies: ``gen`` (the sequence's generator: model, KV + GDN state), ``spec_backend`` (a
    :class:`TTSpecBackend` on ``gen`` with ``capped_accept``; None without an MTP head), ``blocks`` (vLLM's block
    tables against the KV pool)."""

    slots = 1

    def __init__(self, gen, spec_backend, blocks: BlockTables, *, spec_k: int, spec_depth: str = "fixed",
                 depth_costs: str = DEPTH_COSTS, uses_mrope: bool = False):
        self.gen, self.model, self.state = gen, gen.model, gen.state
        self.spec_backend, self.blocks = spec_backend, blocks
        self.batch = SpecBatch(spec_backend) if spec_backend is not None else None
        self.spec_k, self.spec_depth, self.depth_costs = spec_k, spec_depth, depth_costs
        self.uses_mrope = uses_mrope
        self.request: SpecRequest | None = None  # the live sequence's request on ``batch``
        self.controller = None  # the depth controller of the live sequence (auto)
        if self.spec_depth == "auto":
            self.new_controller()
        self.mode = None  # None (no sequence) | "new" (after prefill) | "spec"
        self._accepted_count = None  # tokens committed by the last spec call (1 right after prefill)

    def new_controller(self):
        """A new sequence (or the launch): acceptance estimates start from the fitted prior."""
        k_max = min(int(self.spec_k), max_depth(self.model.args.cfg))
        self.controller = depth_controller(k_max, self.depth_costs)
        return self.controller

    def depth_plan(self) -> dict:
        if self.spec_depth == "fixed":
            return {"mode": "fixed", "depths": (self.spec_k,) if self.spec_k else (), "next_k": self.spec_k}
        nxt = self.request.next_k if self.request is not None else None
        return {"mode": "auto", "depths": tuple(self.controller.depths), "next_k": nxt,
                "costs": self.controller.describe()}

    def on_kv_pool(self, num_blocks: int) -> None:
        """vLLM's pool replaced the model's cache (``blocks`` holds its size): the generator and the speculative
        backend read it directly."""

    def release_traces(self) -> None:
        """The generator's and the speculative backend's traces are the model class's to release."""

    def _live_rows(self, positions: torch.Tensor, what: str) -> None:
        """Row 0 is the sequence; every other row must be a padding row (position -1 in the first column)."""
        first = positions.reshape(positions.shape[0], -1)[:, 0]
        live = [i for i in range(1, first.numel()) if int(first[i]) >= 0]
        if live:
            raise NotImplementedError(f"{what}: rows {live} carry a second live request; {ONE_USER}")

    def _bind_page_table(self, page_table) -> None:
        """Copy the sequence's row of vLLM's block table into the model's persistent page-table buffer (host ->
        device, outside any trace) when it changed."""
        if page_table is None:
            return
        pt = torch.as_tensor(page_table)
        if pt.dim() != 2:
            raise ValueError(f"page_table must be [B, max_blocks], got shape {tuple(pt.shape)}")
        new = self.blocks.row(pt, 0)
        host = self.state.page_table_host
        if torch.equal(host[0], new):
            return
        host[0] = new
        ttnn, dev = self.gen.ttnn, self.state.page_table
        h = ttnn.from_torch(host.clone(), dtype=dev.dtype, layout=dev.layout,
                            mesh_mapper=ttnn.ReplicateTensorToMesh(dev.device()))
        ttnn.copy_host_to_device_tensor(h, dev)

    # ---- prefill -------------------------------------------------------------------------------------------
    def prefill(self, tokens, lens, start_pos, page_table, empty_slots, sampling_params, enable_trace: bool):
        """Prefill the sequence ``tokens[0, :lens[0]]`` from position 0 (with ``sampling_params``: greedy only,
        the argmax id back)."""
        if tokens.shape[0] > 1:
            raise NotImplementedError(f"prefill of {tokens.shape[0]} requests in one call: {ONE_USER}")
        start = 0 if start_pos is None else int(torch.as_tensor(start_pos).reshape(-1)[0])
        if empty_slots is not None and list(empty_slots) != [0]:
            raise NotImplementedError(f"empty_slots={list(empty_slots)}: the only state slot is 0; {ONE_USER}")
        if start != 0:
            raise NotImplementedError(f"prefill start_pos=[{start}]: a speculative launch prefills from position 0 "
                                      f"only and sends every decode step as a verify (supports_narrow_decode=False)")
        self._bind_page_table(page_table)
        prompt = tokens[0, : int(lens[0])].tolist()
        logits = self._prefill(prompt)
        out = logits.reshape(1, 1, -1)
        if sampling_params is not None:  # sample_on_device_mode "all": the runner expects the first token
            self._request_params(sampling_params)  # greedy without penalties, or refused
            out = logits.reshape(1, -1).argmax(-1, keepdim=True).to(torch.int32)
        if self.uses_mrope:
            return out, torch.zeros(1, dtype=torch.int64)
        return out

    def _prefill(self, prompt: list[int]) -> torch.Tensor:
        if self.spec_backend is not None:
            self._drop()  # a new sequence replaces the last one (the plugin does not always say it finished)
            self.spec_backend.use_trace = self.gen.use_trace
            # a new sequence: (auto) acceptance estimates start from the fitted prior
            depth = self.new_controller() if self.spec_depth == "auto" else FixedDepth(self.spec_k)
            # greedy (the verify serves argmax_ids); the join also keeps the MTP's h_t. The engine never ends the
            # request (vLLM does, by release_request or a new prefill): its token limit is the context
            self.request = self.batch.add(prompt, self.model.args.max_seq_len, depth)
            logits = self.spec_backend.prefill_logits
        else:
            logits = self.gen.prefill(prompt)
        self.mode, self._accepted_count = "new", 1
        return logits

    # ---- sampling (sample_on_device_mode) ------------------------------------------------------------------
    def _request_params(self, sampling_params):
        """Row 0 of the plugin's payload as our params: under speculation greedy without penalties only."""
        params = sampling_from_plugin(sampling_params, self.model.args.cfg.vocab_size, 0)
        if not params.greedy or params.penalized:
            raise NotImplementedError(f"speculative launch: {params.describe()} requested, but the verify serves "
                                      f"greedy requests without penalties only (accept mode argmax_ids; the plugin "
                                      f"admits no other request under speculation)")
        return params

    # ---- decode / verify -----------------------------------------------------------------------------------
    def decode(self, tokens, pos, page_table, enable_trace: bool, read_from_device: bool, sampling_params,
               num_valid_drafts, accepted_counts, spec_mode, extra: dict):
        """The verify step of the sequence (row 0; other rows padding); a plain decode is refused."""
        self._live_rows(pos, "decode_forward")
        if self.mode is None:
            raise RuntimeError("decode_forward with no live sequence (prefill_forward first)")
        self._bind_page_table(page_table)
        if spec_mode is not None:
            if sampling_params is not None:
                self._request_params(sampling_params)  # greedy without penalties, or refused
            out = self._verify(tokens, pos, num_valid_drafts, accepted_counts, spec_mode, enable_trace)
            return out
        if num_valid_drafts is not None or accepted_counts is not None:
            # a TypeError, as the plugin's reference model raises: a caller that sends the side tensors and forgets
            # the mode called this wrong and must not get a plain decode back
            raise TypeError("num_valid_drafts / accepted_counts arrive together with spec_mode, never without")
        raise NotImplementedError("plain decode_forward in a speculative launch: every decode step is a verify "
                                  "(spec_mode argmax_ids; supports_narrow_decode=False)")

    def _enter(self, mode: str) -> None:
        if self.spec_backend is None:
            raise NotImplementedError("speculative decoding needs the checkpoint's MTP head (mtp_num_hidden_layers"
                                      " = 0 here)")
        self.mode = mode

    def _check_accepted(self, accepted_counts, rows: int) -> None:
        if accepted_counts is None:
            raise ValueError("spec step needs accepted_counts[B] (tokens the previous step committed; 1 after the "
                             "prefill)")
        ac = torch.as_tensor(accepted_counts).reshape(-1)
        if ac.numel() != rows:
            raise ValueError(f"accepted_counts has {ac.numel()} rows, the block {rows}")
        if int(ac[0]) != self._accepted_count:
            raise ValueError(f"accepted_counts[0]={int(ac[0])} selects state slot {int(ac[0]) - 1}, but the device "
                             f"committed slot {self._accepted_count - 1} ({self._accepted_count} tokens): our step "
                             f"commits on device with the greedy count, a different slot is not supported")

    def _verify(self, tokens, pos, num_valid_drafts, accepted_counts, spec_mode, enable_trace: bool):
        if spec_mode != vt.ACCEPT_MODE_ARGMAX_IDS:
            raise NotImplementedError(f"spec_mode={spec_mode!r}: this model serves {vt.ACCEPT_MODE_ARGMAX_IDS!r}")
        b, k = tokens.shape[0], tokens.shape[1] - 1
        if k < 1 or b < 1 or tuple(pos.shape) != tuple(tokens.shape):
            raise ValueError(f"verify needs tokens and start_pos [B, 1+K] with at least one row and K >= 1, got "
                             f"{tuple(tokens.shape)} and {tuple(pos.shape)}")
        # the contract's domain for the side tensors, on every row (padding rows too): both sides check the same
        vt.check_spec_side_tensors(num_valid_drafts, accepted_counts, b, k)
        self._enter("spec")
        self._check_accepted(accepted_counts, b)
        if num_valid_drafts is None:
            raise ValueError("spec_mode needs num_valid_drafts[B]")
        nv_all = torch.as_tensor(num_valid_drafts).reshape(-1)
        nv = int(nv_all[0])
        if nv_all.numel() != b or not 0 <= nv <= k:
            raise ValueError(f"num_valid_drafts {nv_all.tolist()} must be [B={b}] in [0, K={k}]")
        row = [int(t) for t in tokens[0].tolist()]
        prow = [int(p) for p in pos[0].tolist()]
        n = self.spec_backend.position(0)
        if row[0] != self.spec_backend.history[-1] or prow[0] != n:
            raise ValueError(f"verify row 0 (token {row[0]} at {prow[0]}) must be the pending token "
                             f"{self.spec_backend.history[-1]} at position {n}")
        if prow[: nv + 1] != list(range(n, n + nv + 1)):
            raise ValueError(f"verify positions {prow[: nv + 1]} != {list(range(n, n + nv + 1))}")
        self.spec_backend.use_trace = bool(enable_trace)
        kd = self._step_depth(k)  # the depth of this step: the block width, or (auto) the controller's choice
        if nv > kd:
            raise ValueError(f"num_valid_drafts={nv} but this step drafted {kd} (propose_draft_tokens' num_valid)")
        drafts = row[1: nv + 1]
        self._open()
        # the engine's step with vLLM's drafts: placeholder columns past nv are never accepted (capped acceptance),
        # and the depth controller (auto) learns from the nv drafts offered
        self.batch.step(drafts={0: drafts})
        acc = self.request.last
        ids = self.spec_backend.verify_ids(0)
        host_a = 0
        while host_a < nv and drafts[host_a] == int(ids[host_a]):
            host_a += 1
        if host_a != acc.num_accepted:
            raise RuntimeError(f"device acceptor accepted {acc.num_accepted} drafts but the argmax ids imply {host_a}")
        self._accepted_count = acc.num_accepted + 1
        out = torch.zeros(b, k + 1, dtype=torch.int32)  # padding rows / columns past this step's depth: never read
        out[0, : kd + 1] = ids.to(torch.int32)
        return vt.VerifyOutput(spec_mode=vt.ACCEPT_MODE_ARGMAX_IDS, argmax_ids=out, hidden=None)

    def _step_depth(self, width: int) -> int:
        """Depth of the open step: the launch's K (fixed; the block width), or the controller's choice for it
        (auto; the block width is the deepest step)."""
        if self.spec_depth == "fixed":
            if width != self.spec_k:
                raise ValueError(f"verify block width K={width} != the launch's num_speculative_tokens {self.spec_k}")
            return width
        if width < self.controller.k_max:
            raise ValueError(f"verify block width K={width} < the deepest step {self.controller.k_max}")
        return self.request.next_k

    def _open(self) -> None:
        """Open the sequence's step (the drafts of the last commit; the first step after a prefill drafts here)
        unless propose_draft_tokens already did."""
        if not self.batch.is_open:
            self.batch.draft()

    def _drop(self) -> None:
        """Forget the live request: its open step (an outstanding proposal) and its slot."""
        if self.batch.is_open:
            self.batch.abort()
        if self.request is not None and self.request.slot >= 0:
            self.batch.leave(self.request)
        self.request = None

    def propose(self, num_drafts: int, committed_tokens, committed_positions, accepted_counts, hidden):
        """``DraftOutput(draft_token_ids [B, K] int32, num_valid [B] int32)`` from the device MTP: the drafts its
        chain already wrote after the last commit (moves no state). ``committed_tokens`` [B, 1+K]: this step's
        committed block; entry ``accepted_counts - 1`` of row 0 is the pending token. Padding rows get
        placeholder ids and ``num_valid`` 0. ``hidden`` is None: the MTP reads the verify hidden on device."""
        if hidden is not None:
            raise NotImplementedError("hidden must be None: the MTP reads the verify's hidden state on device "
                                      "(spec_hidden_handoff on_device)")
        ct = batch_rows(committed_tokens, "committed_tokens")
        cp = torch.as_tensor(committed_positions)
        b, width = ct.shape[0], int(num_drafts)
        if ct.dim() != 2 or tuple(cp.shape) != tuple(ct.shape) or b < 1 or ct.shape[1] != width + 1:
            raise ValueError(f"propose needs committed tokens and positions of one shape [B, 1+K] (K = num_drafts "
                             f"= {width}, at least one row), got {tuple(ct.shape)} and {tuple(cp.shape)}")
        vt.check_spec_side_tensors(torch.zeros(b, dtype=torch.int32), accepted_counts, b, width, call="propose")
        self._enter("spec")
        self._check_accepted(accepted_counts, b)
        k = self._step_depth(width)
        pending = int(ct.reshape(b, -1)[0, self._accepted_count - 1])
        if pending != self.spec_backend.history[-1]:
            raise ValueError(f"committed token {pending} (entry {self._accepted_count - 1}) != the model's pending "
                             f"token {self.spec_backend.history[-1]}")
        self._open()
        drafts = self.spec_backend.draft_ids(0)
        ids = torch.full((b, width), vt.PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        ids[0, :k] = torch.tensor(drafts, dtype=torch.int32)
        nv = torch.zeros(b, dtype=torch.int32)
        nv[0] = k  # auto: the controller's depth for this step (<= the width vLLM reserved)
        return vt.DraftOutput(draft_token_ids=ids, num_valid=nv)

    # ---- request lifecycle ---------------------------------------------------------------------------------
    def release(self, slot: int) -> None:
        """A finished / preempted request: forget the sequence (its GDN state is zeroed by the next prefill)."""
        if int(slot) != 0:
            raise ValueError(f"release_request(slot={slot}): the only state slot is 0")
        if self.spec_backend is not None:
            self._drop()  # with the outstanding proposal, which belongs to the released request
        self.mode, self._accepted_count = None, None

    def check_moved(self, moved: dict) -> None:
        if moved:
            raise NotImplementedError(f"state slots moved {moved}: the only state slot is 0 ({ONE_USER})")

    def check_remap(self, remap) -> None:
        r = torch.as_tensor(remap).reshape(-1)
        if r.numel() and int(r[0]) != 0:
            raise NotImplementedError(f"slot_remap {r.tolist()}: row 0 must read slot 0 ({ONE_USER})")

    def warmup_prefill(self, lens: list[int]) -> None:
        self._bind_page_table(self.blocks.warm())
        for n in lens:
            self._prefill([i % self.model.args.cfg.vocab_size for i in range(1, n + 1)])
        self.release(0)

    def warmup_decode(self, steps: int, enable_trace: bool, sampled: bool = False) -> None:
        """The step of this launch: the K-draft verify + commit + MTP chain (``sampled`` adds nothing: the
        verify serves greedy requests only)."""
        self._bind_page_table(self.blocks.warm())
        self.gen.use_trace = bool(enable_trace)
        prompt = [1, 2]
        first = int(self._prefill(prompt).argmax())
        k = self.spec_k
        self.spec_backend.use_trace = bool(enable_trace)
        pos, tok, ac, block = len(prompt), first, 1, [first]
        for i in range(steps):  # as the runner: the first verify after a prefill carries no drafts
            nv, drafts = 0, [vt.PLACEHOLDER_TOKEN_ID] * k
            if i:
                pad = [vt.PLACEHOLDER_TOKEN_ID] * (k + 1 - len(block))
                d = self.propose(k, torch.tensor([block + pad], dtype=torch.int32),
                                 torch.tensor([list(range(pos - ac + 1, pos + 1)) + [-1] * len(pad)], dtype=torch.int32),
                                 torch.tensor([ac], dtype=torch.int32), None)
                nv, drafts = int(d.num_valid[0]), d.draft_token_ids[0].tolist()  # auto: nv <= k
            v = self.decode(torch.tensor([[tok] + drafts]), torch.tensor([[pos + j if j <= nv else -1 for j in range(k + 1)]]),
                            None, bool(enable_trace), True, None, torch.tensor([nv], dtype=torch.int32),
                            torch.tensor([ac], dtype=torch.int32), vt.ACCEPT_MODE_ARGMAX_IDS, {})
            a = self._accepted_count - 1
            block = v.argmax_ids[0, : a + 1].tolist()
            tok, pos, ac = block[-1], pos + a + 1, a + 1
        self.release(0)
