"""The emulator's conformance cases, written from Tenstorrent's own tests for the hand-emulated ops
(``cases.run_cases``; the probe ``qwen36 probe emu-conformance`` runs them, tests/emulator/test_conformance.py runs
the CI subset). They ship with the probes because that probe does; the emulator itself never loads them
(tests/test_layering.py)."""
