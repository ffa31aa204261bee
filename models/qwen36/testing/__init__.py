"""Helpers used only by tests and probes: nothing in the production path imports this package."""
