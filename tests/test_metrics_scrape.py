"""Metrics from every process of a running cluster (gateway, prefill and decode processes started
through entrypoints.cluster, stories260K): each series METRICS.md lists is exported where it says
and moves after traffic as it says; and a real Prometheus server, configured by
compose/prometheus.yml (its targets pointed at this cluster), scrapes them and answers queries
for tandem_ series through its HTTP API."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from entrypoints.cluster import Cluster, ClusterProcess, free_port, worker_process
from harness import wait_until
from metrics_table import REPO, Scrape, parse, series
from tandem import Client, Tier
from tandem.errors import TandemError

WAIT = 90.0
PREFIX = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park "
          "with her big red ball and her friend Tom. One day")
PROMPTS = [PREFIX + tail for tail in (" they", " she saw", " the sun", " a dog", " it rained", " Tom said")]


@pytest.fixture(scope="module")
def cluster(stories_dir: Path, tmp_path_factory):
    """kind -> [(process, metrics port)] for a gateway, a prefill and a decode process."""
    work = tmp_path_factory.mktemp("metrics-cluster")
    flags = ["--metrics-port", "0", "--num-kv-blocks", "128"]
    p = worker_process("prefill-0", "prefill", stories_dir, work, [*flags, "--worker-id", "prefill-0"])
    d = worker_process("decode-0", "decode", stories_dir, work, [*flags, "--worker-id", "decode-0"])
    c = Cluster([p, d])
    c.start(WAIT)
    try:
        gw_port, gw_metrics = free_port(), free_port()
        gw = c.add(ClusterProcess("gateway", "gateway",
                                  ["--model", str(stories_dir), "--port", str(gw_port), "--prefill", p.address,
                                   "--decode", d.address, "--metrics-port", str(gw_metrics), "--log-level", "WARNING"],
                                  gw_port, log_path=work / "gateway.log"), WAIT)
        procs = {"gateway": [(gw, gw_metrics)], "prefill": [(p, p.info["metrics_port"])],
                 "decode": [(d, d.info["metrics_port"])]}
        wait_until(lambda: scrape(gw_metrics).sums.get("tandem_gateway_workers_up", 0) == 2, WAIT,
                   what="the gateway to see both workers")
        yield procs
    finally:
        c.stop()


def scrape(port: int) -> Scrape:
    return parse(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def scrape_all(procs) -> dict[tuple[str, str], Scrape]:
    return {(kind, p.name): scrape(port) for kind, items in procs.items() for p, port in items}


def traffic(target: str) -> None:
    """Requests of every tier, streamed and unary, sharing a prefix (twice each: the second is a
    prefix-cache hit), and one request the gateway rejects."""
    tiers = [Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH]
    with Client(target, timeout=WAIT) as client:
        def one(i: int) -> None:
            kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True, tier=tiers[i % 3])
            if i % 2:
                assert sum(len(ch.token_ids) for ch in client.stream(PROMPTS[i % len(PROMPTS)], **kw)) == 12
            else:
                assert len(client.generate(PROMPTS[i % len(PROMPTS)], **kw).token_ids) == 12

        for i in range(len(PROMPTS)):  # one at a time first, so the prefix is cached before the rest
            one(i)
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, range(len(PROMPTS), 3 * len(PROMPTS))))
        with pytest.raises(TandemError) as err:
            client.generate("too long", max_tokens=10**6)
        assert err.value.code.name == "INVALID_ARGUMENT"


def test_every_listed_series_is_exported_and_moves_after_traffic(cluster) -> None:
    rows = series()
    target = cluster["gateway"][0][0].address
    before = scrape_all(cluster)
    traffic(target)
    time.sleep(0.5)  # workers refresh their snapshots after each step; let the last ones land
    after = scrape_all(cluster)
    problems = []
    for (kind, name), now in after.items():
        was = before[(kind, name)]
        for s in rows:
            if not s.lives_on(kind):
                continue
            if not {s.family, s.name} & now.families:  # text format 0.0.4 keeps _total in # TYPE
                problems.append(f"{name}: {s.name} not exported")
                continue
            if s.after_traffic == "on event":
                continue
            if s.sample not in now.sums:
                problems.append(f"{name}: {s.name} has no sample")
                continue
            missing = [lab for lab in s.labels for got in now.labels[s.sample] if lab not in got]
            if missing:
                problems.append(f"{name}: {s.name} lacks labels {sorted(set(missing))}")
            if s.after_traffic == "grows" and not now.sums[s.sample] > was.sums.get(s.sample, 0.0):
                problems.append(f"{name}: {s.sample} did not grow ({was.sums.get(s.sample)} -> {now.sums[s.sample]})")
    assert not problems, "\n".join(problems)
    gw = after[("gateway", "gateway")]
    for tier in ("interactive", "standard", "batch"):  # per-tier latency histograms saw every tier
        counts = [lab for lab in gw.labels["tandem_gateway_time_to_first_token_seconds_count"] if lab["tier"] == tier]
        assert counts, tier
    assert any(lab["status"] == "INVALID_ARGUMENT" for lab in gw.labels["tandem_gateway_errors_total"])
    pre = after[("prefill", "prefill-0")]
    assert pre.sums["tandem_prefix_cache_hit_ratio"] > 0  # the repeated prefix was found
    for (kind, _), now in after.items():
        usage = now.sums.get("tandem_kv_cache_usage_perc")
        assert kind == "gateway" or 0.0 <= usage <= 1.0


def prometheus_config(procs, scrape_interval: str = "1s") -> dict:
    """compose/prometheus.yml with each job's targets pointed at this cluster's processes (the job
    names are the compose services' roles: tandem-gateway, tandem-prefill, tandem-decode)."""
    cfg = yaml.safe_load((REPO / "compose" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = scrape_interval
    cfg["global"]["evaluation_interval"] = scrape_interval
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    for kind, items in procs.items():
        job = jobs[f"tandem-{kind}"]  # KeyError: compose/prometheus.yml lacks a job for this process kind
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}" for _, port in items]}]
    for name, job in jobs.items():
        if name.startswith("tandem-") and name[len("tandem-"):] not in procs:
            job["static_configs"] = []
    return cfg


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_the_cluster_with_the_compose_config(cluster, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("no prometheus server (Debian's `prometheus` package; .ci/run installs it where apt works)")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(cluster)))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        traffic(cluster["gateway"][0][0].address)

        def up() -> list[dict] | None:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-3000:]}")
            try:
                res = query(port, "up == 1")
            except OSError:
                return None
            return res if len(res) == 3 else None

        jobs = {r["metric"]["job"] for r in wait_until(up, WAIT, interval=0.5, what="prometheus to scrape 3 targets")}
        assert jobs == {"tandem-gateway", "tandem-prefill", "tandem-decode"}
        for promql, job in (("tandem_gateway_requests_total", "tandem-gateway"),
                            ("tandem_kv_blocks_total", "tandem-prefill"),
                            ("tandem_generation_tokens_total", "tandem-decode"),
                            ("process_cpu_seconds_total", "tandem-decode")):
            res = wait_until(lambda q=promql, j=job: query(port, f'{q}{{job="{j}"}}'), WAIT, interval=0.5,
                             what=f"samples of {promql}")
            assert all(float(r["value"][1]) >= 0 for r in res)
        total = query(port, "sum(tandem_gateway_generation_tokens_total)")
        assert float(total[0]["value"][1]) > 0
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_tandem_health_exits_zero_only_when_serving(cluster) -> None:
    """The containers' health check: `tandem health --target HOST:PORT`."""
    import sys

    for kind in ("gateway", "prefill", "decode"):
        proc = cluster[kind][0][0]
        res = subprocess.run([sys.executable, "-m", "entrypoints", "health", "--target", proc.address],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert res.returncode == 0 and "SERVING" in res.stdout, (kind, res.stdout, res.stderr)
    res = subprocess.run([sys.executable, "-m", "entrypoints", "health", "--target", f"127.0.0.1:{free_port()}",
                          "--timeout", "1"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 1 and "UNREACHABLE" in res.stdout, res.stdout
    res = subprocess.run([sys.executable, "-m", "entrypoints", "health", "--target", "nocolon"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 2 and "--target" in res.stderr
