"""The two consoles every command prints through: results to stdout, progress and errors to stderr."""

from rich.console import Console

out_console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
