"""The operator's files in deploy/: the Grafana dashboard, the Prometheus alerting rules and the systemd units.

Every metric the dashboard and the rules name is one a real engine (SSD tier and MetaServer on, after some traffic)
or a real MetaServer exports, under the labels it carries; the files are well formed and their flags are the
engine's real flags; and, where the tools are installed, promtool accepts the rules and the dashboard's queries, the
rules fire on the failures they name and stay quiet on healthy series, and systemd-analyze accepts the units.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, Meta, _Engines, save_blocks, wait_until
from prometheus_client.parser import text_string_to_metric_families

from kvseal.cli import parse_args, serve_config
from kvseal.memfd import SharedArray
from kvseal.server.addresses import lane_socket_path
from kvseal.testing.process import EngineProcess, free_port, http_get
from kvseal.testing.worker import register_one_rank

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvseal.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ENGINE_UNIT = DEPLOY / "systemd" / "kvseal.service"
META_UNIT = DEPLOY / "systemd" / "kvseal-metaserver.service"
ENGINE_JOB, META_JOB = "kvseal", "kvseal-metaserver"  # the scrape jobs alerts.yml expects (stated in its comment)
DASHBOARD_SCOPE = {"$instance": ENGINE_JOB, "$metaserver": META_JOB}  # the dashboard's instance variables
TARGET_LABELS = {"job", "instance"}  # added by Prometheus at scrape time, never in the exposition
SEVERITIES = {"critical", "warning", "info"}
# what the rules must cover (the operator's list): a rule file that drops one fails here
REQUIRED_ALERTS = {
    "KvsealEngineDown",
    "KvsealHitRatioCollapsed",
    "KvsealLoadsRefused",
    "KvsealSsdVerifyFailures",
    "KvsealSsdPathFailed",
    "KvsealPeerFetchesFailing",
    "KvsealMetaServerUnreachable",
    "KvsealEngineLockHeldLong",
}
# and what the dashboard must show: pool by state, hit ratio, refusals, copies, SSD, peers, locks, RPC latency
REQUIRED_DASHBOARD_METRICS = {
    "kvseal_pool_used_bytes",
    "kvseal_pool_free_bytes",
    "kvseal_hits_total",
    "kvseal_misses_total",
    "kvseal_refusals_total",
    "kvseal_save_bytes_total",
    "kvseal_load_bytes_total",
    "kvseal_ssd_reads_total",
    "kvseal_ssd_writes_total",
    "kvseal_ssd_skipped_total",
    "kvseal_ssd_verify_failures_total",
    "kvseal_ssd_bytes",
    "kvseal_peer_hits_total",
    "kvseal_peer_fetch_bytes_total",
    "kvseal_engine_lock_hold_seconds_bucket",
    "kvseal_rpc_seconds_bucket",
}
SELECTOR = re.compile(r"\b(kvseal_[A-Za-z0-9_:]*|up(?=\s*\{))\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
DURATION = re.compile(r"(?:\d+(?:ms|s|m|h|d|w|y))+")
DURATION_PART = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
GRAFANA_VARIABLE = re.compile(r"\$(?:\{[A-Za-z0-9_]+\}|[A-Za-z0-9_]+)")


# ---------------------------------------------------------------- what a real engine and MetaServer export


@dataclass
class Exposition:
    """One /metrics answer: every sample name it may carry (from its # TYPE lines: a histogram's _bucket, _sum and
    _count), and for the names that have samples now, the label names and values seen."""

    names: set[str] = field(default_factory=set)
    labels: dict[str, dict[str, set[str]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Exposition:
        out = cls()
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
                out.names.update(name + s for s in suffixes.get(kind, ("",)))
                if kind == "counter" and not name.endswith("_total"):  # OpenMetrics names the family without it
                    out.names.add(name + "_total")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                seen = out.labels.setdefault(sample.name, {})
                for key, value in sample.labels.items():
                    seen.setdefault(key, set()).add(value)
        return out


@dataclass
class Scrapes:
    engine: Exposition
    metaserver: Exposition

    def of(self, job: str) -> Exposition:
        return self.engine if job == ENGINE_JOB else self.metaserver


def _traffic(engine: EngineProcess, meta: Meta) -> None:
    """Saves blocks, queries them from a second instance (hits, and a miss that asks the MetaServer), and makes a
    peer fetch fail: a fake node announces blocks at an address nobody listens on, and a query for them tries it."""
    hashes = [f"deploy-{i}".encode().ljust(32, b".") for i in range(8)]
    namespace = save_blocks(engine, "deploy-a", "deploy", hashes)
    ghost = [f"ghost-{i}".encode().ljust(32, b".") for i in range(4)]
    meta.heartbeat("ghost", session="ghost-session", address=f"127.0.0.1:{free_port()}")
    assert meta.announce("ghost", ghost, session="ghost-session", ns=namespace) == len(ghost)
    shared = SharedArray((len(hashes), 16384))
    try:
        with engine.client(timeout=30) as client:
            register_one_rank(client, "deploy-b", shared, namespace="deploy", layout_tag="t", dtype="uint8")
            answer = client.query("deploy-b", [*hashes, b"missing".ljust(32, b".")])
            assert answer.hits == len(hashes), answer
            client.release("deploy-b", answer.lease_id)
            client.query("deploy-b", ghost)  # a miss the MetaServer says the fake node holds: fetched, and fails
            wait_until(
                lambda: engine.metric("kvseal_peer_fetch_failures_total", reason="unreachable"),
                20,
                "the fetch from the unreachable fake node to fail",
            )
    finally:
        shared.close()


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrapes]:
    """/metrics of one real engine (SSD tier on, announcing to a real MetaServer) and of that MetaServer, after
    some traffic."""
    base = tmp_path_factory.mktemp("deploy")
    meta = Meta(base)
    try:
        engines = _Engines(base)
        try:
            ssd = base / "ssd"
            ssd.mkdir(mode=0o700)
            engine = engines.start(
                *("--metaserver", f"127.0.0.1:{meta.port}", "--node-id", "deploy-node"),
                *("--ssd-path", str(ssd), "--ssd-capacity", "64MiB", "--ssd-segment-size", "4MiB"),
                *("--pool-size", "32MiB", "--slab-size", "1MiB"),
            )
            _traffic(engine, meta)
            status, body = http_get(f"http://127.0.0.1:{meta.http_port}/metrics")
            assert status == 200, body
            yield Scrapes(Exposition.parse(engine.metrics_text()), Exposition.parse(body.decode()))
        finally:
            engines.stop_all()
    finally:
        assert meta.stop() == 0, meta.log.read_text()


# ---------------------------------------------------------------- the files' expressions


def load_alerts() -> dict[str, Any]:
    with open(ALERTS) as f:
        document = yaml.safe_load(f)
    assert isinstance(document, dict), f"{ALERTS}: not a mapping"
    return document


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_alerts()["groups"] for rule in group["rules"]]


def load_dashboard() -> dict[str, Any]:
    with open(DASHBOARD) as f:
        document = json.load(f)
    assert isinstance(document, dict), f"{DASHBOARD}: not an object"
    return document


def dashboard_targets() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) of every query of the dashboard."""
    return [(panel, target) for panel in load_dashboard()["panels"] for target in panel.get("targets", [])]


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, [(label, operator, value)]) of every kvseal_* and up{} selector in a PromQL expression."""
    return [(name, MATCHER.findall(body or "")) for name, body in SELECTOR.findall(expr)]


def expressions() -> list[tuple[str, str]]:
    """(where, expression) of every query of the dashboard and every rule."""
    out = [(f"alerts.yml {rule['alert']}", rule["expr"]) for rule in alert_rules()]
    for panel, target in dashboard_targets():
        out.append((f"kvseal.json panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"]))
    return out


def selector_job(matchers: list[tuple[str, str, str]]) -> str:
    """The scrape job a selector picks: its `job="..."` (the rules), or the component of the dashboard variable
    in its `instance=~"$..."`; "" when it does not say."""
    jobs = {v for k, op, v in matchers if k == "job" and op == "="}
    jobs |= {DASHBOARD_SCOPE.get(v, "") for k, op, v in matchers if k == "instance" and op == "=~"}
    return jobs.pop() if len(jobs) == 1 else ""


@pytest.mark.process
def test_every_metric_the_dashboard_and_rules_name_is_exported_with_those_labels(scrapes: Scrapes) -> None:
    """Each kvseal_* name in any expression is on the /metrics of the component it selects (engine or MetaServer),
    every selector names its component, the labels it matches on are ones that metric carries, and the histogram
    bounds it picks (le) are real bounds."""
    problems = []
    for where, expr in expressions():
        for name, matchers in selectors(expr):
            job = selector_job(matchers)
            if not job:
                problems.append(f'{where}: {name} does not say whose metric it is (job=... / instance=~"$...")')
                continue
            if job != ENGINE_JOB and job != META_JOB:
                problems.append(f"{where}: job {job!r} is neither {ENGINE_JOB!r} nor {META_JOB!r}")
                continue
            if name == "up":
                continue
            exposition = scrapes.of(job)
            if name not in exposition.names:
                problems.append(f"{where}: {name} is not on the {job} /metrics")
                continue
            seen = exposition.labels.get(name)
            for label, op, value in matchers:
                if label in TARGET_LABELS or seen is None:
                    continue  # a family with no sample yet (nothing refused, say) shows no labels to check
                if label not in seen:
                    problems.append(f"{where}: {name} has no label {label!r} (it has {sorted(seen)})")
                elif label == "le" and op == "=" and value not in seen["le"]:
                    problems.append(f"{where}: {name} has no bucket le={value!r} (bounds {sorted(seen['le'])})")
    for variable in load_dashboard()["templating"]["list"]:  # label_values(NAME, instance) of that component
        job = DASHBOARD_SCOPE.get(f"${variable['name']}", "")
        for name, _ in selectors(variable["definition"]):
            if not job or name not in scrapes.of(job).names:
                problems.append(f"kvseal.json variable {variable['name']}: {name} is not on the {job} /metrics")
    assert not problems, "\n".join(problems)


@pytest.mark.process
def test_the_scrapes_hold_what_the_checks_rely_on(scrapes: Scrapes) -> None:
    """The check above is only as good as the scrapes: both tiers and the peer side were on, and the traffic
    reached hits, the MetaServer lookups and a failed peer fetch (so their labels were checked)."""
    for name in ("kvseal_ssd_verify_failures_total", "kvseal_peer_fetch_failures_total", "kvseal_hits_total"):
        assert name in scrapes.engine.labels, f"{name} has no sample on the engine's /metrics"
    assert "kvseal_metaserver_rpc_seconds_bucket" in scrapes.engine.labels
    assert {"kvseal_meta_nodes", "kvseal_meta_rpc_seconds_bucket"} <= scrapes.metaserver.names


# ---------------------------------------------------------------- structure


def duration_seconds(text: str) -> float:
    """A Prometheus duration (5m, 1h30m, 0s) in seconds; ValueError when it is not one."""
    if not DURATION.fullmatch(text):
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * SECONDS[unit] for n, unit in DURATION_PART.findall(text))


def test_alert_rules_are_complete_and_well_formed() -> None:
    """Every rule has alert, expr, a valid `for`, a known severity, a summary and a description; names are
    unique; and the rules cover each failure the operator asked for."""
    document = load_alerts()
    groups = document.get("groups")
    assert isinstance(groups, list) and groups, "alerts.yml has no groups"
    assert len({g["name"] for g in groups}) == len(groups), "group names repeat"
    names = []
    for group in groups:
        assert group.get("rules"), f"group {group.get('name')} has no rules"
        for rule in group["rules"]:
            name = rule.get("alert")
            assert isinstance(name, str) and name, f"a rule of group {group['name']} has no alert name: {rule}"
            assert isinstance(rule.get("expr"), str) and rule["expr"].strip(), f"{name}: no expr"
            assert duration_seconds(str(rule.get("for"))) >= 0, name
            assert rule.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity not one of {SEVERITIES}"
            annotations = rule.get("annotations", {})
            for key in ("summary", "description"):
                assert isinstance(annotations.get(key), str) and annotations[key].strip(), f"{name}: no {key}"
            names.append(name)
    assert len(set(names)) == len(names), f"alert names repeat: {names}"
    assert REQUIRED_ALERTS <= set(names), f"missing alerts: {sorted(REQUIRED_ALERTS - set(names))}"
    assert duration_seconds("1h30m") == 5400 and duration_seconds("0s") == 0
    with pytest.raises(ValueError):
        duration_seconds("5 minutes")


def test_dashboard_is_well_formed() -> None:
    """Schema ~39, the Prometheus data source as the DS_PROMETHEUS input, an $instance variable; every panel has
    a unique id, that data source, a place on the 24-column grid and targets with an expr; and the panels show
    what the operator asked for (RPC latency as percentiles of the histogram)."""
    d = load_dashboard()
    assert 36 <= d["schemaVersion"] <= 41
    inputs = {i["name"]: i for i in d["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource" and inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["instance"]["type"] == "query" and variables["instance"]["datasource"] == source
    assert set(DASHBOARD_SCOPE) == {f"${name}" for name in variables}, "a variable the checks do not know"
    ids = [p["id"] for p in d["panels"]]
    assert len(set(ids)) == len(ids), f"panel ids repeat: {ids}"
    for panel in d["panels"]:
        title = f"panel {panel['id']} {panel.get('title')!r}"
        assert panel.get("datasource") == source, f"{title}: data source {panel.get('datasource')}"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, title
        targets = panel.get("targets")
        assert targets, f"{title}: no targets"
        assert len({t["refId"] for t in targets}) == len(targets), f"{title}: refIds repeat"
        for t in targets:
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), f"{title}: a target without expr"
            assert t.get("datasource", source) == source, f"{title}: target data source {t.get('datasource')}"
    used = {name for _, target in dashboard_targets() for name, _ in selectors(target["expr"])}
    assert REQUIRED_DASHBOARD_METRICS <= used, f"not on the dashboard: {sorted(REQUIRED_DASHBOARD_METRICS - used)}"
    assert any(
        "histogram_quantile" in t["expr"] and "kvseal_rpc_seconds_bucket" in t["expr"] for _, t in dashboard_targets()
    )


# ---------------------------------------------------------------- the systemd units


def unit_settings(path: Path) -> dict[str, list[str]]:
    """'Section.Key' -> its values in order, of a systemd unit file (continuation lines joined)."""
    out: dict[str, list[str]] = {}
    section = ""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def exec_argv(settings: dict[str, list[str]], variable: str) -> list[str]:
    """ExecStart's command line, without the $VARIABLE of extra flags (asserted to be there, last)."""
    (line,) = settings["Service.ExecStart"]
    argv = shlex.split(line)
    assert argv[-1] == f"${variable}", f"ExecStart should end with ${variable} (the operator's flags): {argv}"
    return argv[:-1]


@pytest.mark.parametrize(
    ("unit", "command", "variable"),
    [(ENGINE_UNIT, "serve", "KVSEAL_SERVE_ARGS"), (META_UNIT, "metaserver", "KVSEAL_METASERVER_ARGS")],
)
def test_units_run_real_flags_as_a_dedicated_user_restarting_on_failure(
    unit: Path, command: str, variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ExecStart runs an absolute `kvseal` with flags that `kvseal` itself accepts (its own parser and checks), as
    a user other than root, with the optional environment file, Restart=on-failure and a raised LimitNOFILE."""
    monkeypatch.delenv("KVSEAL_TOKEN", raising=False)
    settings = unit_settings(unit)
    argv = exec_argv(settings, variable)
    assert os.path.isabs(argv[0]) and Path(argv[0]).name == "kvseal", argv
    assert argv[1] == command, argv
    try:
        parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"{unit.name}: `kvseal {' '.join(argv[1:])}` is refused by kvseal's parser (exit {e.code})")
    assert settings["Service.User"][0] not in ("", "root", "0")
    assert settings["Service.Restart"] == ["on-failure"]
    assert any(v.startswith("-/etc/default/") for v in settings["Service.EnvironmentFile"])
    assert int(settings["Service.LimitNOFILE"][0]) >= 65536
    assert settings["Service.ProtectSystem"] == ["strict"]


def test_engine_unit_keeps_the_lane_socket_visible_and_its_memory_lockable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane socket the engine computes from the unit's flags (the engine's own lane_socket_path) is in the
    unit's RuntimeDirectory, never in a /tmp that PrivateTmp hides from the workers; the pool may be page-locked
    (LimitMEMLOCK=infinity, CUDA copies) and the SSD directory is writable under ProtectSystem=strict."""
    monkeypatch.delenv("KVSEAL_TOKEN", raising=False)
    settings = unit_settings(ENGINE_UNIT)
    argv = exec_argv(settings, "KVSEAL_SERVE_ARGS")
    lane = Path(lane_socket_path(serve_config(parse_args(argv[1:])), 50055))
    runtime = [Path("/run") / d for v in settings["Service.RuntimeDirectory"] for d in v.split()]
    assert lane.parent in runtime, f"lane socket {lane} is not in a RuntimeDirectory ({runtime})"
    if settings.get("Service.PrivateTmp") == ["yes"]:
        assert not lane.is_relative_to("/tmp") and not lane.is_relative_to("/var/tmp"), lane
    assert settings["Service.LimitMEMLOCK"] == ["infinity"]
    writable = settings.get("Service.StateDirectory", []) + settings.get("Service.ReadWritePaths", [])
    assert any("ssd" in v for v in writable), "no writable directory for --ssd-path"
    assert "AF_NETLINK" in settings["Service.RestrictAddressFamilies"][0], "tokenless loopback clients need sock_diag"


# ---------------------------------------------------------------- the tools, where installed

PROMTOOL = shutil.which("promtool")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")
needs_systemd_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")


def run_tool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    """promtool parses every rule: expressions, durations, annotation templates."""
    assert PROMTOOL is not None
    r = run_tool(PROMTOOL, "check", "rules", str(ALERTS))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@needs_promtool
def test_promtool_accepts_the_dashboards_queries(tmp_path: Path) -> None:
    """Every dashboard query, its Grafana variables filled in, is valid PromQL (checked as recording rules)."""
    assert PROMTOOL is not None
    rules = []
    for panel, target in dashboard_targets():
        expr = target["expr"].replace("$__rate_interval", "5m").replace("$__interval", "1m")
        expr = GRAFANA_VARIABLE.sub(".*", expr)
        rules.append({"record": f"kvseal_dashboard:panel{panel['id']}_{target['refId']}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = run_tool(PROMTOOL, "check", "rules", str(path))
    assert r.returncode == 0 and f"SUCCESS: {len(rules)} rules found" in r.stdout, r.stdout + r.stderr


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    body = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{body}}}", "values": values}


def _alert_cases() -> dict[str, tuple[list[dict[str, str]], str, list[dict[str, str]]]]:
    """Per alert: input series (one minute apart), when to evaluate, and the alerts' labels expected to fire
    then. Each case holds a failing target and a healthy one that must not fire."""
    e, m = {"job": ENGINE_JOB}, {"job": META_JOB}
    a, b = {"instance": "a:9091"}, {"instance": "b:9091"}
    return {
        "KvsealEngineDown": (
            [_series("up", "1 1 1 0x10", **e, **a), _series("up", "1x13", **e, **b)],
            "8m",
            [{**e, **a, "severity": "critical"}],
        ),
        "KvsealMetaServerDown": (
            [_series("up", "1 1 1 0x10", **m, **a), _series("up", "1x13", **m, **b)],
            "8m",
            [{**m, **a, "severity": "critical"}],
        ),
        "KvsealMetaServerUnreachable": (
            [
                _series(
                    "kvseal_metaserver_rpc_seconds_count", "0+1x20", **e, **a, method="QueryPrefix", code="UNAVAILABLE"
                ),
                _series("kvseal_metaserver_rpc_seconds_count", "0+5x20", **e, **b, method="QueryPrefix", code="OK"),
            ],
            "15m",
            [{**a, "code": "UNAVAILABLE", "severity": "warning"}],
        ),
        "KvsealHitRatioCollapsed": (
            [  # a: 90% for 6 h, then 10%; b: 90% throughout
                _series("kvseal_hits_total", "0+90x360 32410+10x40", **e, **a, namespace="n", uid="1"),
                _series("kvseal_misses_total", "0+10x360 3690+90x40", **e, **a, namespace="n", uid="1"),
                _series("kvseal_hits_total", "0+90x400", **e, **b, namespace="n", uid="1"),
                _series("kvseal_misses_total", "0+10x400", **e, **b, namespace="n", uid="1"),
            ],
            "400m",
            [{**a, "severity": "warning"}],
        ),
        "KvsealLoadsRefused": (
            [
                _series("kvseal_refusals_total", "0+1x30", **e, **a, namespace="n", uid="1", reason="slot_bytes"),
                _series("kvseal_refusals_total", "5x30", **e, **b, namespace="n", uid="1", reason="slot_bytes"),
            ],
            "25m",
            [{**a, "namespace": "n", "reason": "slot_bytes", "severity": "warning"}],
        ),
        "KvsealEngineLockHeldLong": (
            [  # a: one hold a minute over 50 ms; b: every hold under it
                _series("kvseal_engine_lock_hold_seconds_count", "0+10x30", **e, **a),
                _series("kvseal_engine_lock_hold_seconds_bucket", "0+9x30", **e, **a, le="0.05"),
                _series("kvseal_engine_lock_hold_seconds_count", "0+10x30", **e, **b),
                _series("kvseal_engine_lock_hold_seconds_bucket", "0+10x30", **e, **b, le="0.05"),
            ],
            "25m",
            [{**a, "severity": "warning"}],
        ),
        "KvsealMetaServerLockHeldLong": (
            [
                _series("kvseal_meta_lock_hold_seconds_count", "0+10x30", **m, **a),
                _series("kvseal_meta_lock_hold_seconds_bucket", "0+9x30", **m, **a, le="0.05"),
                _series("kvseal_meta_lock_hold_seconds_count", "0+10x30", **m, **b),
                _series("kvseal_meta_lock_hold_seconds_bucket", "0+10x30", **m, **b, le="0.05"),
            ],
            "25m",
            [{**a, "severity": "warning"}],
        ),
        "KvsealSsdVerifyFailures": (
            [
                _series("kvseal_ssd_verify_failures_total", "0 0 0 1x10", **e, **a, reason="checksum"),
                _series("kvseal_ssd_verify_failures_total", "0x13", **e, **a, reason="digest"),
            ],
            "6m",
            [{**a, "reason": "checksum", "severity": "warning"}],
        ),
        "KvsealSsdPathFailed": (
            [
                _series("kvseal_ssd_path_failed", "0 0 1x10", **e, **a, path="/ssd0"),
                _series("kvseal_ssd_path_failed", "0x12", **e, **a, path="/ssd1"),
            ],
            "6m",
            [{**e, **a, "path": "/ssd0", "severity": "critical"}],
        ),
        "KvsealPeerFetchesFailing": (
            [  # a: timeouts; b: only the MetaServer (another alert's); c: pages that failed their checksum
                _series("kvseal_peer_fetch_failures_total", "0+1x20", **e, **a, reason="timeout"),
                _series("kvseal_peer_fetch_failures_total", "0+1x20", **e, **b, reason="metaserver"),
                _series(
                    "kvseal_peer_refusals_total", "0+1x20", **e, instance="c:9091", side="fetch", reason="checksum"
                ),
                _series("kvseal_peer_refusals_total", "0+1x20", **e, instance="c:9091", side="serve", reason="busy"),
            ],
            "15m",
            [
                {**a, "reason": "timeout", "severity": "warning"},
                {"instance": "c:9091", "reason": "checksum", "severity": "warning"},
            ],
        ),
    }


@needs_promtool
def test_each_alert_fires_on_its_failure_and_not_on_healthy_series(tmp_path: Path) -> None:
    """promtool's rule unit tests, one case per alert (every alert has one): the failing target fires with the
    expected labels once `for` has passed, the healthy one never does, and nothing fires at the start."""
    assert PROMTOOL is not None
    rules = load_alerts()
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # promtool compares annotations too: these tests are about expr and for
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    cases = _alert_cases()
    assert set(cases) == {r["alert"] for r in alert_rules()}, "every alert needs a case here, and only those"
    tests = []
    for alert, (series, at, expected) in cases.items():
        checks = [
            {"eval_time": "1m", "alertname": alert, "exp_alerts": []},
            {"eval_time": at, "alertname": alert, "exp_alerts": [{"exp_labels": labels} for labels in expected]},
        ]
        tests.append({"interval": "1m", "input_series": series, "alert_rule_test": checks})
    spec = tmp_path / "rules_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}))
    r = subprocess.run(
        [PROMTOOL, "test", "rules", spec.name], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@needs_systemd_analyze
def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    """systemd-analyze verify accepts both units with no warning about them (an unknown key, a bad value), their
    ExecStart pointed at this environment's kvseal."""
    assert SYSTEMD_ANALYZE is not None
    kvseal = Path(sys.executable).with_name("kvseal")
    assert kvseal.is_file() and os.access(kvseal, os.X_OK), f"{kvseal}: the venv's console script"
    copies = []
    for unit in (ENGINE_UNIT, META_UNIT):
        (line,) = unit_settings(unit)["Service.ExecStart"]
        installed = shlex.split(line)[0]
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace(f"ExecStart={installed} ", f"ExecStart={kvseal} "))
        assert str(kvseal) in copy.read_text(), f"{unit.name}: ExecStart not rewritten"
        copies.append(copy)
    r = run_tool(SYSTEMD_ANALYZE, "verify", "--man=no", *map(str, copies))
    ours = [line for line in (r.stdout + r.stderr).splitlines() if any(c.name in line for c in copies)]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr
