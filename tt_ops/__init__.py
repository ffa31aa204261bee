"""TT runtime foundation: device entry point (device.py), emulated mesh (emulator/), cost model, op compositions."""
