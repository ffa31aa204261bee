"""Probes: scripts that check one property on a named backend and append one run record (DESIGN 6).
Registered by name in :mod:`probes.registry`; run with ``qwen36 probe NAME --device DEV``."""
