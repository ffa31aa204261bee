"""Exceptions raised by the emulated mesh. Each message names the rule and what to do instead."""


class EmulatorError(RuntimeError):
    """A device rule or op contract was violated on the emulated mesh (would fail or misbehave on cards)."""


class TraceRuleError(EmulatorError):
    """A trace-capture rule that bites on cards was violated."""


class NotEmulatedError(EmulatorError):
    """The op or mode exists in ttnn but the emulator has no faithful emulation for it."""
