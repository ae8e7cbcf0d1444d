"""``ferry models …``: list the known models and fetch (convert) them into the cache."""

from __future__ import annotations

import click


@click.group()
def models() -> None:
    """Model files: the default model is converted once into the cache."""


@models.command("list")
def list_models() -> None:
    """Known model names, whether they are cached, and the random-weight shapes."""
    from libs.common.models import KNOWN_MODELS, cache_dir

    for name, desc in sorted(KNOWN_MODELS.items()):
        cached = (cache_dir() / name / ".complete").exists()
        click.echo(f"{name:16} {'cached' if cached else 'not cached':11} {desc}")
    try:
        from services.instance.engine.native.config import SHAPES

        click.echo(f"random-weight shapes (native engine): {', '.join(sorted(SHAPES))}")
    except ImportError:  # torch missing: shapes need it
        pass
    click.echo(f"cache: {cache_dir()} (set FERRY_CACHE_DIR to move it)")


@models.command()
@click.argument("name", default="smollm2")
def fetch(name: str) -> None:
    """Convert NAME into the cache (once) and print its directory."""
    from libs.common.models import ModelNotFound, ensure_model, model_max_len

    try:
        path = ensure_model(name)
    except ModelNotFound as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{name}: {path} (max_model_len {model_max_len(path)})")
