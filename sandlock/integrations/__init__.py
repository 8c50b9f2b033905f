"""Adapters that plug sandlock into MCP, agent frameworks, coding agents and CI; each imports its framework lazily."""
