"""Static checks of deploy/k8s (no API server runs here):

1. both kustomizations (the GPU base, the CPU overlay) render with
   ``kubectl kustomize`` and every object validates, strictly (no unknown
   field), against the Kubernetes 1.32 JSON schemas shipped in the
   ``kubernetes-validate`` package; broken objects fail;
2. every Ferry container's arguments and FERRY_* environment parse with
   ferry's own click parser (downward-API values stand in as a pod would
   see them), and addresses point at Services that select the right pods
   on the right ports; probes probe the ports the services listen on;
3. the NetworkPolicies, evaluated here, leave only the frontend reachable
   from outside, and each inner service reachable only by its callers;
4. the scheduler's ServiceAccount may only get and patch the scale of the
   instances' StatefulSet; only the scheduler mounts an API token;
5. every workload has a PodDisruptionBudget; instances ask for a GPU in the
   base and none on CPU, take their id and address from the pod, and stop by
   SIGTERM with a long grace period (the drain by live migration);
6. every Ferry pod says where Prometheus scrapes it (annotations) and serves
   /metrics there; the monitoring overlay's PodMonitors pick each kind of pod
   by a port it has, under the job names the dashboards and rules select,
   and its NetworkPolicy opens only the metrics ports, to Prometheus pods.
"""

from __future__ import annotations

import copy
import pathlib
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.test_compose import ENV_PREFIX, parse_service

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.32"
TARGETS = {"base": "base", "cpu": "overlays/cpu"}
MONITORING = "overlays/monitoring"
DOWNWARD = {"metadata.name": "ferry-instance-0", "metadata.namespace": "ferry", "status.podIP": "10.0.0.7"}

kubectl = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(kubectl is None, reason="kubectl (with kustomize) is not installed")


# --------------------------------------------------------------------------- rendering
@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) is not installed")
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("cluster-token"))
    (tree / "base" / "secrets" / "cluster-token").write_text("test-token\n")
    out = {}
    for name, path in {**TARGETS, "monitoring": MONITORING}.items():
        r = subprocess.run([kubectl, "kustomize", str(tree / path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{name}: kubectl kustomize failed: {r.stderr}"
        out[name] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return out


def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def component(obj: dict) -> str:
    return obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


@needs_kubectl
def test_the_cluster_token_is_not_committed_and_kustomize_needs_it(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "deploy/k8s"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "cluster-token" not in tracked.replace("secrets/.gitignore", "")
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("cluster-token"))
    r = subprocess.run([kubectl, "kustomize", str(tree / "base")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "cluster-token" in r.stderr


# ----------------------------------------------------------------- 1. the schemas
def validate(doc: dict) -> str | None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def schemas():
    pytest.importorskip("kubernetes_validate", reason="the Kubernetes schemas ship in kubernetes-validate")


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_object_validates_strictly(rendered, schemas, target):
    errors = {f"{d['kind']}/{d['metadata']['name']}": e for d in rendered[target] if (e := validate(d))}
    assert errors == {}
    kinds = {d["kind"] for d in rendered[target]}
    assert {"Namespace", "Secret", "Deployment", "StatefulSet", "Service", "NetworkPolicy",
            "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding"} <= kinds


def _mutations():
    def probe_typo(docs):
        c = one(docs, "Deployment", "ferry-meta-store")["spec"]["template"]["spec"]["containers"][0]
        c["readinessProbe"]["grpc"]["prot"] = 7000

    def replicas_as_text(docs):
        one(docs, "Deployment", "ferry-frontend")["spec"]["replicas"] = "two"

    def env_without_name(docs):
        c = one(docs, "StatefulSet", "ferry-instance")["spec"]["template"]["spec"]["containers"][0]
        del c["env"][0]["name"]

    def bad_policy_type(docs):
        one(docs, "NetworkPolicy", "ferry-scheduler")["spec"]["policyTypes"] = "Ingress"

    def pdb_both_bounds_typo(docs):
        one(docs, "PodDisruptionBudget", "ferry-instance")["spec"]["maxUnavailabe"] = 1

    return [probe_typo, replicas_as_text, env_without_name, bad_policy_type, pdb_both_bounds_typo]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_broken_objects_fail_validation(rendered, schemas, mutate):
    docs = copy.deepcopy(rendered["base"])
    before = {id(d): validate(d) for d in docs}
    assert not any(before.values())
    mutate(docs)
    assert any(validate(d) for d in docs), f"{mutate.__name__}: the schema accepted a broken object"


# ------------------------------------------------------- 2. commands, addresses, probes
def ferry_containers(docs: list[dict]):
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            if c["image"].startswith("ferry:"):
                yield w, c


def as_service(c: dict) -> dict:
    """A container as test_compose's parser takes a compose service."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = DOWNWARD[e["valueFrom"]["fieldRef"]["fieldPath"]]
    assert "envFrom" not in c
    return {"command": c["args"], "environment": env}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_ferry_container_parses(rendered, target, monkeypatch):
    seen = set()
    for w, c in ferry_containers(rendered[target]):
        svc = as_service(c)
        parsed = parse_service(f"{w['metadata']['name']}/{c['name']}", svc, monkeypatch)
        known = {p.envvar for p in parsed.command.params if getattr(p, "envvar", None)}
        unknown = sorted(k for k in svc["environment"] if k.startswith(ENV_PREFIX) and k not in known)
        assert not unknown, f"{w['metadata']['name']}: environment variables no option reads: {unknown}"
        seen.add(tuple(parsed.path))
    assert {("serve", "meta-store"), ("serve", "scheduler"), ("serve", "frontend"), ("serve", "instance"),
            ("models", "fetch")} <= seen


def parsed_services(docs, monkeypatch) -> dict[str, tuple[dict, dict, dict]]:
    """component -> (workload, container, parsed params) of the serving containers."""
    out = {}
    for w, c in ferry_containers(docs):
        if c["args"][0] != "serve":
            continue
        out[component(w)] = (w, c, parse_service(w["metadata"]["name"], as_service(c), monkeypatch).params)
    return out


def service_target(docs, address: str) -> tuple[str, int]:
    """host:port of a Service -> (the component its selector picks, container port)."""
    host, _, port = address.rpartition(":")
    svc = one(docs, "Service", host)
    sel = svc["spec"]["selector"]
    port_spec = next(p for p in svc["spec"]["ports"] if p["port"] == int(port))
    picked = [w for w in workloads(docs) if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                                                  for k, v in sel.items())]
    assert len(picked) == 1, f"{address}: selects {len(picked)} workloads"
    w = picked[0]
    ports = {p["name"]: p["containerPort"] for c in w["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    target = port_spec["targetPort"]
    return component(w), ports[target] if isinstance(target, str) else target


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_addresses_ports_and_probes_agree(rendered, target, monkeypatch):
    docs = rendered[target]
    svcs = parsed_services(docs, monkeypatch)
    assert set(svcs) == {"meta-store", "scheduler", "frontend", "instance"}
    for comp, (w, c, p) in svcs.items():
        assert p["host"] == "0.0.0.0", comp
        declared = {q["containerPort"] for q in c["ports"]}
        assert p["port"] in declared, f"{comp}: --port {p['port']} is not a container port"
        named = {q["name"]: q["containerPort"] for q in c["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            handler = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
            port = handler["port"]
            port = named[port] if isinstance(port, str) else port
            assert port == p["port"], f"{comp} {kind} probes {port}, serves {p['port']}"
        assert "readinessProbe" in c and "livenessProbe" in c, comp
    # gRPC health on the gRPC services, /live and /health on the frontend.
    fe = svcs["frontend"][1]
    assert fe["livenessProbe"]["httpGet"]["path"] == "/live"
    assert fe["readinessProbe"]["httpGet"]["path"] == "/health"
    for comp in ("meta-store", "scheduler", "instance"):
        assert "grpc" in svcs[comp][1]["readinessProbe"], comp
    for comp, addr_opt, want in [("instance", "meta_store", "meta-store"), ("scheduler", "meta_store", "meta-store"),
                                 ("frontend", "meta_store", "meta-store"), ("frontend", "scheduler", "scheduler")]:
        got, port = service_target(docs, svcs[comp][2][addr_opt])
        assert got == want and port == svcs[want][2]["port"], f"{comp} --{addr_opt}"
    for comp in ("meta-store", "scheduler"):
        got, port = service_target(docs, svcs[comp][2]["etcd"])
        assert (got, port) == ("etcd", 2379), comp


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_ferry_pod_mounts_the_generated_token(rendered, target, monkeypatch):
    docs = rendered[target]
    secret = [s for s in objects(docs, "Secret") if s["metadata"]["name"].startswith("ferry-cluster-token")]
    assert len(secret) == 1 and "token" in secret[0]["data"]
    for comp, (w, c, p) in parsed_services(docs, monkeypatch).items():
        vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        mount = next(m for m in c["volumeMounts"] if vols[m["name"]].get("secret"))
        assert vols[mount["name"]]["secret"]["secretName"] == secret[0]["metadata"]["name"], comp
        assert p["cluster_token_file"] == f"{mount['mountPath']}/token", comp


# ---------------------------------------------------------------- 3. NetworkPolicies
def _matches(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] in ("In", "NotIn", "Exists"), e
        has = e["key"] in labels
        if e["operator"] == "Exists" and not has:
            return False
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "NotIn" and labels.get(e["key"]) in e["values"]:
            return False
    return True


def reachable(docs, source: dict | None, dest_labels: dict, port: int) -> bool:
    """Ingress to a pod with ``dest_labels`` on ``port`` from a pod of this
    namespace with labels ``source`` (None: from outside the namespace)."""
    selecting = [p for p in objects(docs, "NetworkPolicy")
                 if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _matches(p["spec"]["podSelector"], dest_labels)]
    if not selecting:
        return True
    for pol in selecting:
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(q.get("port") == port for q in ports):
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                assert "namespaceSelector" not in peer and "ipBlock" not in peer, peer
                if source is not None and _matches(peer["podSelector"], source):
                    return True
    return False


CALLERS = {  # who must reach whom: component -> port -> the components that call it
    # metrics ports: none of the cluster's own; the monitoring overlay opens them to Prometheus
    "meta-store": {7000: {"instance", "scheduler", "frontend"}, 9102: set()},
    "scheduler": {7001: {"frontend"}, 9101: set()},
    "instance": {7100: {"frontend", "scheduler", "instance"}, 9100: set()},
    "etcd": {2379: {"meta-store", "scheduler", "etcd"}, 2380: {"etcd"}},
    "frontend": {8000: None},  # anyone
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_only_the_frontend_is_reachable_and_each_service_only_by_its_callers(rendered, target):
    docs = rendered[target]
    pods = {component(w): w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)}
    assert set(pods) == set(CALLERS)
    for dest, labels in pods.items():
        w = next(x for x in workloads(docs) if component(x) == dest)
        ports = {q["containerPort"] for c in w["spec"]["template"]["spec"]["containers"] for q in c["ports"]}
        assert ports == set(CALLERS[dest]), dest
        for port, callers in CALLERS[dest].items():
            outside = reachable(docs, None, labels, port)
            assert outside == (callers is None), f"{dest}:{port} reachable from outside: {outside}"
            for src, src_labels in pods.items():
                ok = reachable(docs, src_labels, labels, port)
                assert ok == (callers is None or src in callers), f"{dest}:{port} from {src}: {ok}"


# ---------------------------------------------------------------------- 4. RBAC
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_scheduler_may_only_scale_the_instances(rendered, target, monkeypatch):
    docs = rendered[target]
    svcs = parsed_services(docs, monkeypatch)
    sched_w, _, sched = svcs["scheduler"]
    sts = one(docs, "StatefulSet", "ferry-instance")
    assert sched["launcher"] == "kubernetes" and sched["k8s_statefulset"] == sts["metadata"]["name"]
    sa = sched_w["spec"]["template"]["spec"]["serviceAccountName"]
    bindings = [b for b in objects(docs, "RoleBinding") + objects(docs, "ClusterRoleBinding")
                if any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b["subjects"])]
    assert len(bindings) == 1 and bindings[0]["kind"] == "RoleBinding"
    role = one(docs, "Role", bindings[0]["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["statefulsets/scale"],
                              "resourceNames": [sts["metadata"]["name"]], "verbs": ["get", "patch"]}]
    assert objects(docs, "ClusterRole") == []
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        assert spec.get("automountServiceAccountToken") is (w is sched_w), w["metadata"]["name"]


# ---------------------------------------------------- 5. PDBs and the instances
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_workload_has_a_disruption_budget(rendered, target):
    docs = rendered[target]
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        pdbs = [p for p in objects(docs, "PodDisruptionBudget") if _matches(p["spec"]["selector"], labels)]
        assert len(pdbs) == 1, w["metadata"]["name"]
        replicas = w["spec"].get("replicas")
        if "minAvailable" in pdbs[0]["spec"] and replicas is not None:
            assert pdbs[0]["spec"]["minAvailable"] < replicas, w["metadata"]["name"]  # a drain can proceed


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_instances_come_from_their_pods_and_drain_on_sigterm(rendered, target, monkeypatch):
    docs = rendered[target]
    sts = one(docs, "StatefulSet", "ferry-instance")
    spec = sts["spec"]["template"]["spec"]
    c = spec["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["FERRY_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["FERRY_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # The autoscaler owns replicas; kubectl apply must not reset it.
    assert "replicas" not in sts["spec"]
    assert sts["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    # Stopping is SIGTERM (the instance drains by live migration), given time.
    assert "lifecycle" not in c and spec["terminationGracePeriodSeconds"] >= 300
    assert "tcpSocket" in c["livenessProbe"]  # NOT_SERVING while draining must not restart it
    params = parsed_services(docs, monkeypatch)["instance"][2]
    gpu = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if target == "base":
        assert gpu == 1 and params["engine"] == "vllm" and params["device"] == "cuda"
        assert c["image"] == "ferry:cuda"
    else:
        assert gpu is None and params["engine"] == "native" and params["device"] == "cpu"
        assert c["image"] == "ferry:cpu" and spec["initContainers"][0]["image"] == "ferry:cpu"


# ---------------------------------------------------------- 6. Prometheus
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_ferry_pod_says_where_prometheus_scrapes_it(rendered, target, monkeypatch):
    svcs = parsed_services(rendered[target], monkeypatch)
    for comp, (w, c, p) in svcs.items():
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        assert ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/path") == "/metrics", comp
        port = int(ann["prometheus.io/port"])
        assert port in {q["containerPort"] for q in c["ports"]}, comp
        served = p["port"] if comp == "frontend" else p["metrics_port"]  # the frontend: on its HTTP port
        assert served == port, f"{comp} serves /metrics on {served}, annotated {port}"


def test_the_monitoring_overlay_scrapes_every_kind_of_pod_under_its_job(rendered, schemas):
    from ferry.targets import JOBS

    docs = rendered["monitoring"]
    native = [d for d in docs if d["kind"] != "PodMonitor"]
    assert {f"{d['kind']}/{d['metadata']['name']}": e for d in native if (e := validate(d))} == {}
    monitors = objects(docs, "PodMonitor")
    assert sorted(m["metadata"]["name"] for m in monitors) == sorted(JOBS.values())
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        picked = [w for w in workloads(docs) if _matches(m["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert [component(w) for w in picked] == [m["metadata"]["name"].removeprefix("ferry-")]
        ports = {q["name"] for c in picked[0]["spec"]["template"]["spec"]["containers"] for q in c["ports"]}
        (ep,) = m["spec"]["podMetricsEndpoints"]
        assert ep["port"] in ports and ep["path"] == "/metrics"
        assert {"targetLabel": "job", "replacement": m["metadata"]["name"]} in ep["relabelings"]
    policy = one(docs, "NetworkPolicy", "ferry-metrics-from-prometheus")
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    assert rule["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    # The rest is the base's, unchanged.
    base = {(d["kind"], d["metadata"]["name"]) for d in rendered["base"]}
    assert base == {(d["kind"], d["metadata"]["name"]) for d in native} - {("NetworkPolicy", policy["metadata"]["name"])}
