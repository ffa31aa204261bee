"""Backend-agnostic speculative decoding (MTP drafts, packed K+1 verify, greedy + stochastic acceptance, three
GDN commit mechanisms, autoregressive oracle). No ttnn here.

Read ``greedy_loop.py`` first: one ~40-line function, ``greedy_speculative_generate``, that does greedy MTP
speculative decoding on the reference model and names the four parts of a step (draft, verify, accept, commit).
The engine (``engine.py``: one backend protocol over user slots, one user being B = 1; ``SpecBatch.step`` runs
one step of every running user, telling a backend that drafts inside its commit the next depths between accept and
commit; ``speculative_generate`` drives it over a list of prompts) runs the same step over any backend, the torch
reference (``reference_backend.py``) or the TT model, with acceptance (``acceptance.py``; the sampling transform is
``qwen36.generation.sampling``) and the commit mechanisms; ``oracle.py`` replays a step one row at a time to check a
committed state against.
"""
