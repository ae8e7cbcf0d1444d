"""The ``ferry`` command line. Subcommands live in their own modules and are
imported lazily so that ``ferry --help`` stays fast."""

from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    """A click group whose subcommands are ``module:attribute`` strings,
    imported on first use."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = lazy or {}

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, attr = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(
    cls=LazyGroup,
    lazy={
        # --- commands: keep one line per command, sorted ---
        "bench": "ferry.bench.cli:bench",
        "dashboards": "ferry.dashboards:dashboards",
        "models": "ferry.models_cli:models",
        "profile": "ferry.bench.profile_cli:profile",
        "serve": "ferry.serve_cli:serve",
        "sim": "ferry.sim.cli:sim",
        "top": "ferry.top:top",
        "up": "ferry.up:up",
    },
)
@click.version_option(package_name="ferry")
def cli() -> None:
    """Ferry: serve one LLM on many instances, live-migrating requests between them."""


def main() -> None:
    cli()
