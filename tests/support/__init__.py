"""Test support shared by the tests and scripts/ (one module per concern: the TT layer harness, the vLLM call
recorder and replay, the soak oracle, chat API rows, program goldens, the host fingerprint, ...). It is not part of
the installed package: pytest puts tests/ on sys.path (pyproject.toml ``pythonpath``), scripts do so through
scripts/support_path.py. Nothing under models/, tt_ops/ or probes/ imports it (tests/test_layering.py), and the
wheel carries none of it (tests/test_packaging.py)."""
