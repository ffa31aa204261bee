"""Test support that must stay importable from the installed package: the tests use it, and so do the probes
(bf16 test checkpoints for the TP probes, the emulator's conformance cases for emu-conformance). Runtime code
(models, speculative engine, TT backend, tt_ops and its emulator, command line) never imports it
(tests/test_layering.py)."""
