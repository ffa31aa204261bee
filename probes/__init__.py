"""Probes: scripts that check one property on a named backend and append one run record (probes/records.py).
Registered by name in :mod:`probes.registry`; run with ``qwen36 probe NAME --device DEV``."""
