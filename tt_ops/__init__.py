"""TT runtime foundation (import name ``qwen36.tt_ops``): the device entry point (device.py), the one import of the
real ttnn (ttnn_env.py), the emulated mesh (emulator/), the cost model and the ttnn API-fidelity scan. The TT model's
op compositions live in qwen36.tt."""
