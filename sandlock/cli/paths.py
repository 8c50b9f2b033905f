"""A click path type for every command (sandlock.cli.main and sandlock.cli.trace)."""

from __future__ import annotations

from typing import Any

import click


class PathArg(click.Path):
    """click.Path that answers a name it cannot stat (a NUL in it, too long) with a
    usage error; click's own lets the ValueError or OSError escape."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)
        except (OSError, ValueError) as exc:
            self.fail(f"{click.format_filename(value)!r}: {getattr(exc, 'strerror', None) or exc}",
                      param, ctx)
