"""compose/ and deploy/k8s/ are what users run: Debian's docker-compose accepts the compose file,
promtool the Prometheus config, kubernetes-validate (offline schemas) every Kubernetes manifest;
every command line in them parses with the `tandem` CLI's own parsers; the gateway's worker
list, the workers' services and Prometheus's targets name each other consistently; and every
query of the Grafana dashboard names a series METRICS.md lists."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from metrics_table import REPO, metric_names

COMPOSE = REPO / "compose"
K8S = REPO / "deploy" / "k8s"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "tandem.json"


def compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def with_defaults(text: str) -> str:
    """Compose's interpolation with no environment: ${VAR:-default} -> default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def parser_for(subcommand: str):
    """The argparse parser behind `tandem SUBCOMMAND`."""
    from entrypoints import gateway, health, worker

    parsers = {"gateway": gateway.build_parser, "health": health.build_parser,
               "prefill": lambda: worker.build_parser("prefill", "tandem prefill"),
               "decode": lambda: worker.build_parser("decode", "tandem decode"),
               "worker": lambda: worker.build_parser(None, "tandem worker")}
    assert subcommand in parsers, f"tandem {subcommand}: not a subcommand these files may use"
    return parsers[subcommand]()


def parse_tandem(argv: list[str], where: str):
    """Parse `tandem SUB ARGS...` with the CLI's parser; fails naming `where` and the flag."""
    assert argv[0] == "tandem", f"{where}: command should start with `tandem`: {argv}"
    parser = parser_for(argv[1])
    unknown = [a for a in argv[2:] if a.startswith("--") and a.split("=")[0] not in parser._option_string_actions]
    assert not unknown, f"{where}: flags `tandem {argv[1]}` does not have: {unknown}"
    try:
        return parser.parse_args(argv[2:])
    except SystemExit:
        pytest.fail(f"{where}: `tandem {argv[1]}` rejects {argv[2:]} (see stderr)")


def tandem_services(doc: dict) -> dict[str, list[str]]:
    return {name: [with_defaults(str(a)) for a in svc["command"]] for name, svc in doc["services"].items()
            if isinstance(svc.get("command"), list) and svc["command"][0] == "tandem"}


def k8s_docs() -> list[tuple[str, dict]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kust["resources"]) == files, "kustomization.yaml should list every manifest in deploy/k8s/"
    return [(f, d) for f in files for d in yaml.safe_load_all((K8S / f).read_text()) if d]


def k8s_containers() -> list[tuple[str, dict, dict]]:
    """(file, workload, container) of every Tandem container."""
    out = []
    for f, doc in k8s_docs():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c.get("command", [""])[0] == "tandem":
                    out.append((f, doc, c))
    return out


# ---------------------------------------------------------------- compose

def test_docker_compose_accepts_the_compose_file() -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose not installed (Debian's docker-compose; .ci/run installs it where apt works)")
    res = subprocess.run([exe, "-f", str(COMPOSE / "docker-compose.yml"), "config", "-q"], capture_output=True,
                         text=True, timeout=120, cwd=COMPOSE)
    assert res.returncode == 0, res.stderr


def test_promtool_accepts_the_prometheus_config() -> None:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not installed (Debian's prometheus package; .ci/run installs it where apt works)")
    res = subprocess.run([exe, "check", "config", str(COMPOSE / "prometheus.yml")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_commands_parse_with_the_cli_and_name_each_other() -> None:
    doc = compose()
    services = tandem_services(doc)
    assert {"gateway", "prefill-0", "decode-0"} <= set(services)
    args = {name: parse_tandem(argv, f"compose service {name}") for name, argv in services.items()}
    for name, svc in doc["services"].items():  # healthchecks are `tandem health` on the service's own port
        if name in services:
            test = [with_defaults(str(a)) for a in svc["healthcheck"]["test"]]
            assert test[0] == "CMD", name
            health = parse_tandem(test[1:], f"compose service {name} healthcheck")
            assert health.target == f"127.0.0.1:{args[name].port}", name
    gw = args["gateway"]
    workers = {n: a for n, a in args.items() if n != "gateway"}
    listed = {"prefill": set(gw.prefill), "decode": set(gw.decode)}
    for name, a in workers.items():
        role = services[name][1]
        assert f"{name}:{a.port}" in listed[role], f"gateway does not list {name}:{a.port}"
        assert a.host == "0.0.0.0" and a.worker_id == name, name
        assert a.redis_url == gw.redis_url, name
        if role == "decode":  # the KV receiver binds the container's own name, so it advertises its address
            assert a.kv_address.startswith(f"tcp://{doc['services'][name]['hostname']}:"), name
        assert doc["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert sum(map(len, listed.values())) == len(workers), "the gateway lists a worker compose does not run"
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{n}:{a.metrics_port}" for n, a in args.items()}, "prometheus.yml should scrape every process"


def test_dashboard_loads_and_every_query_names_a_listed_series() -> None:
    dash = json.loads(DASHBOARD.read_text())
    known = metric_names()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("throughput", "ttft", "inter-token", "queue depth", "kv cache usage", "hit ratio", "bandwidth",
                  "errors"):
        assert topic in titles, f"no panel about {topic}"
    datasource = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    queries = [t["expr"] for p in panels for t in p["targets"]]
    queries += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    for p in panels:
        assert p["targets"] and p["datasource"]["uid"] == uid, p["title"]
    for q in queries:
        used = set(re.findall(r"\b(?:tandem|process)_[a-z0-9_]+", q))
        assert used, f"query names no Tandem series: {q}"
        assert used <= known, f"{q}: not in METRICS.md: {sorted(used - known)}"
    provider = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "dashboards" / "tandem.yml").read_text())
    mounts = compose()["services"]["grafana"]["volumes"]
    path = provider["providers"][0]["options"]["path"]
    assert any(m.startswith("./grafana/dashboards:") and m.split(":")[1] == path for m in mounts)


# ---------------------------------------------------------------- kubernetes

def test_kubernetes_manifests_validate_offline() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for f, doc in k8s_docs():
        try:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{f}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_kubernetes_commands_parse_with_the_cli_and_name_each_other() -> None:
    docs = dict(((d["kind"], d["metadata"]["name"]), d) for _, d in k8s_docs())
    args, pods = {}, {}
    for f, workload, c in k8s_containers():
        a = parse_tandem([*c["command"], *c["args"]], f"{f} {workload['metadata']['name']}")
        env = {e["name"] for e in c.get("env", [])}
        for ref in re.findall(r"\$\(([A-Z_]+)\)", " ".join(c["args"])):
            assert ref in env, f"{f}: $({ref}) has no env entry"
        ports = {p["containerPort"] for p in c["ports"]}
        assert {a.port, a.metrics_port} <= ports, f
        probe = c["readinessProbe"]["grpc"]["port"]  # readiness is the gRPC health service
        assert probe == a.port, f
        ann = workload["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == a.metrics_port, f
        role = c["command"][1]
        args[role] = a
        if role != "gateway":
            assert workload["kind"] == "StatefulSet", f"{f}: workers need stable names the gateway can list"
            assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1, f
            assert "preStop" in c["lifecycle"], f
            assert a.worker_id == "$(POD_NAME)" and a.host == "0.0.0.0", f
            svc = docs[("Service", workload["spec"]["serviceName"])]
            assert svc["spec"]["clusterIP"] == "None", f"{f}: the StatefulSet's Service must be headless"
            name = workload["metadata"]["name"]
            pods[role] = {f"{name}-{i}.{svc['metadata']['name']}:{a.port}" for i in range(workload["spec"]["replicas"])}
            if role == "decode":  # other pods push KV to the address the receiver binds: the pod's IP
                assert a.kv_address.startswith("tcp://$(POD_IP):"), f
    gw = args["gateway"]
    assert set(gw.prefill) == pods["prefill"] and set(gw.decode) == pods["decode"]
    assert gw.redis_url == args["prefill"].redis_url == args["decode"].redis_url
    redis_host = gw.redis_url.split("//")[1].split(":")[0]
    assert ("Service", redis_host) in docs
    assert ("Service", "gateway") in docs
