"""Backend-agnostic speculative decoding (MTP drafts, packed K+1 verify, greedy + stochastic acceptance, three
GDN commit mechanisms, autoregressive oracle). No ttnn here.

Read ``greedy_loop.py`` first: one ~40-line function, ``greedy_speculative_generate``, that does greedy MTP
speculative decoding on the reference model and names the four parts of a step (draft, verify, accept, commit).
The engine (``engine.py``: ``speculative_generate`` runs the steps of ``speculative_step``, telling a backend that
drafts inside its commit the next depth between accept and commit) runs the same step over any
backend, the torch reference (``reference_backend.py``) or the TT model, with sampling (``acceptance.py``,
``sampling.py``) and the commit mechanisms; ``oracle.py`` is plain decoding to check it against.
"""
