"""sandlock: give every tool call of an AI agent its own sandbox."""

__version__ = "0.1.0"
