"""Test support that must stay importable from the installed package: the tests use it, and so do the TP probes
(bf16 test checkpoints). Production code (models, speculative engine, TT backend, command line) never imports it
(tests/test_layering.py)."""
