"""Validated frozen-dataclass configuration, settable by flags and environment.

Each service declares a frozen dataclass whose fields carry ``opt(...)``
metadata; ``click_options(Config)`` turns the fields into click options
(``--field-name``, env ``FERRY_FIELD_NAME``), and the dataclass validates
itself in ``__post_init__`` through ``validate()``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable

import click

ENV_PREFIX = "FERRY_"


def opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None, min: float | None = None,
        max: float | None = None, flag: str | None = None) -> Any:
    """A config field with help text and validation bounds."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "flag": flag}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class ConfigError(ValueError):
    pass


def validate(cfg: Any) -> None:
    """Check every field against its bounds and choices; raise ConfigError."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        m = f.metadata
        if value is None:
            continue
        if m.get("choices") and value not in m["choices"]:
            raise ConfigError(f"{f.name}={value!r}: expected one of {', '.join(m['choices'])}")
        if m.get("min") is not None and value < m["min"]:
            raise ConfigError(f"{f.name}={value!r}: must be >= {m['min']}")
        if m.get("max") is not None and value > m["max"]:
            raise ConfigError(f"{f.name}={value!r}: must be <= {m['max']}")


class Validated:
    """Mixin: validate on construction."""

    def __post_init__(self) -> None:
        validate(self)


def _click_type(tp: Any, choices):
    if choices:
        return click.Choice(list(choices))
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0]
    return {int: int, float: float, str: str, bool: bool}.get(tp, str)


def click_options(config_cls: type, exclude: tuple[str, ...] = ()) -> Callable:
    """Decorator adding one click option per config field."""
    hints = typing.get_type_hints(config_cls)

    def decorate(fn: Callable) -> Callable:
        for f in reversed(dataclasses.fields(config_cls)):
            if f.name in exclude or not f.metadata.get("help"):
                continue
            name = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            envvar = ENV_PREFIX + f.name.upper()
            tp = hints[f.name]
            default = f.default if f.default is not dataclasses.MISSING else None
            if tp is bool:
                neg = "--no-" + name[2:]
                fn = click.option(f"{name}/{neg}", f.name, default=default, envvar=envvar,
                                  show_default=True, help=f.metadata["help"])(fn)
            else:
                fn = click.option(name, f.name, type=_click_type(tp, f.metadata.get("choices")),
                                  default=default, envvar=envvar, show_default=True,
                                  help=f.metadata["help"])(fn)
        return fn

    return decorate


def from_options(config_cls: type, options: dict[str, Any]) -> Any:
    """Build a config from click's keyword arguments; raises click.BadParameter."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    try:
        return config_cls(**{k: v for k, v in options.items() if k in names})
    except ConfigError as e:
        raise click.BadParameter(str(e)) from e


@dataclasses.dataclass(frozen=True)
class CommonConfig(Validated):
    """Options every service has."""

    host: str = opt("127.0.0.1", "address to listen on (loopback unless told otherwise)")
    port: int = opt(0, "port to listen on (0 = any free port)", min=0, max=65535)
    log_level: str = opt("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = opt("console", "log format", choices=("console", "json"))
    freeze_heap: bool = opt(True, "once serving, freeze what start-up allocated (gc.freeze): the garbage "
                            "collector's full passes then scan only what serving allocates")
    # Internal gRPC credentials (libs/common/rpc.py). Prefer the env var or the
    # file to the flag: a flag's value shows in the process list.
    cluster_token: str = opt("", "shared token every internal gRPC call must carry (empty = none)")
    cluster_token_file: str = opt("", "file holding the cluster token (e.g. a compose secret)")
    tls_cert: str = opt("", "PEM certificate for internal gRPC TLS (this service's, server and client)")
    tls_key: str = opt("", "PEM private key of --tls-cert")
    tls_ca: str = opt("", "PEM CA that peers' certificates must chain to; servers then require client "
                          "certificates (mutual TLS)")
    tls_server_name: str = opt("", "name the peers' certificates are checked against (default: the address's host)")
    # Tracing (libs/common/tracing.py): off unless an endpoint is given.
    otlp_endpoint: str = opt("", "export traces (OpenTelemetry, OTLP/gRPC) to this collector, e.g. "
                                 "http://127.0.0.1:4317 (empty = tracing off)")
    trace_sample_ratio: float = opt(1.0, "share of new traces sampled (a caller's sampled trace context is "
                                         "always followed)", min=0.0, max=1.0)

    def credentials(self):
        """This service's internal gRPC credentials (raises ConfigError on a bad file)."""
        from libs.common import rpc

        try:
            return rpc.load_credentials(self.cluster_token, self.cluster_token_file, self.tls_cert, self.tls_key,
                                        self.tls_ca, self.tls_server_name)
        except (OSError, ValueError) as e:
            raise ConfigError(str(e)) from e
