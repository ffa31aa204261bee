"""Backend-agnostic speculative engine (MTP drafts, packed K+1 verify, greedy + stochastic acceptance,
three GDN commit mechanisms, autoregressive oracle). No ttnn here."""
