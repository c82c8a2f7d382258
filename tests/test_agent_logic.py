"""The agent's decision logic without processes or sleeping: confirmation windows, cool-downs,
baselines from scraped histograms, the drain cap, recovery and escalation."""
from __future__ import annotations

import pytest

from agent.config import AgentConfig, DetectorConfig, config_from_dict
from agent.confirm import Confirmer, Level, Thresholds
from agent.policy import Policy, WorkerView
from agent.signals import Sample, Scrape, WorkerSignals, parse_metrics, SignalConfig

TH = Thresholds(warn=2, act=3, window_s=2.0, cooldown_s=10.0)


def feed(conf: Confirmer, points: list[tuple[float, float | None]]):
    return [conf.observe(t, v) for t, v in points]


def test_one_spike_only_warns():
    conf = Confirmer(TH)
    out = feed(conf, [(0, 1), (0.5, 1), (1.0, 9), (1.5, 1), (2.0, 1), (2.5, 1)])
    levels = [v.level if v else None for v in out]
    assert levels == [None, None, Level.WARN, None, None, None]


def test_act_needs_the_threshold_held_through_the_window():
    conf = Confirmer(TH)
    out = feed(conf, [(0, 5), (0.5, 5), (1.0, 5), (1.5, 5), (2.0, 5)])
    assert [v.level for v in out[:4]] == [Level.WARN] * 4
    assert out[4].level is Level.ACT
    assert out[4].held_s == pytest.approx(2.0)
    assert [v for _, v in out[4].samples] == [5, 5, 5, 5, 5]  # the window's samples as evidence


def test_a_dip_or_a_missing_sample_restarts_the_window():
    for gap in (1.0, None):
        conf = Confirmer(TH)
        out = feed(conf, [(0, 5), (1.0, 5), (1.5, gap), (2.0, 5), (3.0, 5), (3.5, 5)])
        assert all(v is None or v.level is not Level.ACT for v in out), gap
        assert conf.observe(4.0, 5).level is Level.ACT


def test_cooldown_after_a_decision():
    conf = Confirmer(TH)
    feed(conf, [(t, 5) for t in (0, 1, 2)])
    later = feed(conf, [(t, 5) for t in (3, 5, 7, 9, 11)])
    assert all(v.level is Level.WARN for v in later)  # held, but within the cool-down
    assert conf.observe(12.5, 5).level is Level.ACT  # 10 s after the decision at t=2


def test_window_zero_acts_on_the_first_sample():
    conf = Confirmer(Thresholds(1, 3, 0, 60))
    assert conf.observe(0, 1).level is Level.WARN
    assert conf.observe(1, 3).level is Level.ACT


def test_bad_thresholds_and_config_are_named():
    with pytest.raises(ValueError, match="warn"):
        Thresholds(5, 3, 1, 1)
    with pytest.raises(ValueError, match="action"):
        DetectorConfig(1, 2, 1, 1, action="reboot")
    with pytest.raises(ValueError, match="detectors.itl.actt"):
        config_from_dict({"detectors": {"itl": {"actt": 3}}})
    with pytest.raises(ValueError, match="poll"):
        config_from_dict({"poll": 1})
    cfg = config_from_dict({"poll_s": 0.25, "detectors": {"itl": {"act": 4}}})
    assert cfg.poll_s == 0.25 and cfg.detectors["itl"].act == 4 and cfg.detectors["itl"].warn == 2


METRICS = """# TYPE tandem_engine_step_seconds histogram
tandem_engine_step_seconds_bucket{{worker_id="w",role="both",le="0.01"}} {count}
tandem_engine_step_seconds_bucket{{worker_id="w",role="both",le="+Inf"}} {count}
tandem_engine_step_seconds_sum{{worker_id="w",role="both"}} {sum}
tandem_engine_step_seconds_count{{worker_id="w",role="both"}} {count}
# TYPE tandem_engine_steps counter
tandem_engine_steps_total{{worker_id="w",role="both"}} {count}
# TYPE tandem_worker_running_requests gauge
tandem_worker_running_requests{{worker_id="w",role="both"}} {running}
# TYPE tandem_kv_blocks_total gauge
tandem_kv_blocks_total{{worker_id="w",role="both"}} 100
# TYPE tandem_kv_blocks_free gauge
tandem_kv_blocks_free{{worker_id="w",role="both"}} {free}
# TYPE tandem_kv_blocks_evictable gauge
tandem_kv_blocks_evictable{{worker_id="w",role="both"}} 5
# TYPE tandem_worker_rpcs counter
tandem_worker_rpcs_total{{worker_id="w",role="both",method="Decode",code="OK"}} {ok}
tandem_worker_rpcs_total{{worker_id="w",role="both",method="Decode",code="INTERNAL"}} {bad}
"""


def page(t, count, total_s, running=1, free=50, ok=0, bad=0):
    return parse_metrics(METRICS.format(count=count, sum=total_s, running=running, free=free, ok=ok, bad=bad), t)


def test_parse_metrics_reads_the_worker_page():
    s = page(1.0, 10, 0.05, running=3, free=40, ok=7, bad=2)
    assert (s.step_count, s.step_sum, s.steps, s.running) == (10, 0.05, 10, 3)
    assert (s.kv_total, s.kv_free, s.kv_evictable, s.rpcs, s.rpc_errors) == (100, 40, 5, 9, 2)
    with pytest.raises(ValueError):
        parse_metrics("this is { not prometheus", 0)


def signals_over(steps_per_s: int, step_s_by_time, until: float, dt: float = 0.25):
    sig = WorkerSignals("both", SignalConfig(span_s=1.0, latency_floor_s=0.001))
    count, total, out = 0, 0.0, []
    t = 0.0
    while t <= until:
        n = int(steps_per_s * dt)
        count += n
        total += n * step_s_by_time(t)
        out.append((t, sig.update(t, healthy=True, scrape=page(t, count, total), starting=False,
                                  supervisor_restarts=0)))
        t += dt
    return sig, out


def test_latency_ratio_against_the_rolling_baseline():
    sig, out = signals_over(40, lambda t: 0.004 if t < 5 else 0.04, until=8)
    ratios = {t: s["itl"].value for t, s in out}
    assert ratios[4.0] == pytest.approx(1.0)
    assert ratios[8.0] == pytest.approx(10.0)
    assert sig.baseline.value() == pytest.approx(0.004)  # the slow steps did not move the baseline


def test_stuck_kv_pressure_and_error_rate_samples():
    sig = WorkerSignals("decode", SignalConfig(span_s=1.0, min_rpcs=5))
    s0 = sig.update(0, healthy=True, scrape=page(0, 10, 0.1, running=2, free=2), starting=False,
                    supervisor_restarts=None)
    assert s0["kv_pressure"].value == pytest.approx(0.93)
    s1 = sig.update(1, healthy=True, scrape=page(1, 10, 0.1, running=2, free=2, ok=8, bad=2), starting=False,
                    supervisor_restarts=None)
    assert s1["error_rate"].value == pytest.approx(0.2)  # 2 INTERNAL of 10 RPCs in the last span
    s2 = sig.update(3, healthy=True, scrape=page(3, 10, 0.1, running=2, free=2, ok=8, bad=2), starting=False,
                    supervisor_restarts=None)
    assert s2["stuck"].value == pytest.approx(3.0)
    assert s2["error_rate"].value is None  # no RPCs in the last span
    s3 = sig.update(4, healthy=True, scrape=page(4, 2, 0.01), starting=False, supervisor_restarts=None)
    assert s3["restarts"].value == 1  # counters went backwards: a restart seen without a supervisor
    s4 = sig.update(5, healthy=False, scrape=None, starting=True, supervisor_restarts=None)
    assert s4["unresponsive"].value is None  # starting: not judged


def cfg(**kw) -> AgentConfig:
    dets = {"itl": DetectorConfig(2, 3, 2.0, 30, "drain"),
            "unresponsive": DetectorConfig(1, 1, 1.0, 30, "restart"),
            "restarts": DetectorConfig(1, 2, 0, 60, "isolate")}
    return AgentConfig(poll_s=0.5, recover_s=3.0, escalate_s=10.0, detectors=dets, **kw)


W = [WorkerView("a", "h:1", "both"), WorkerView("b", "h:2", "both")]


def run(policy, samples_at):
    out = []
    for t, samples in samples_at:
        out += [(t, d) for d in policy.observe(t, W, samples)]
    return out


def test_policy_drains_after_the_window_then_clears_on_recovery():
    p = Policy(cfg(), can_restart=True)
    slow = [(t / 2, {"h:1": {"itl": Sample(5.0)}, "h:2": {"itl": Sample(1.0)}}) for t in range(0, 6)]
    fine = [(3 + t / 2, {"h:1": {"itl": Sample(1.0)}}) for t in range(0, 9)]
    out = run(p, slow + fine)
    actions = [(t, d.action, d.worker.name) for t, d in out]
    assert actions[0] == (0.0, "warn", "a")
    assert (2.0, "drain", "a") in actions
    assert actions[-1] == (6.0, "clear", "a")  # below warn for recover_s (3 s) from t=3
    drain = next(d for _, d in out if d.action == "drain")
    assert drain.thresholds["window_s"] == 2.0 and len(drain.verdict.samples) == 5


def test_policy_cap_never_drains_the_last_routable_worker():
    p = Policy(cfg(max_unroutable_fraction=1.0), can_restart=False)
    views = [WorkerView("a", "h:1", "both"), WorkerView("b", "h:2", "both", routable=False, mark="drained")]
    out = []
    for t in range(5):
        out += p.observe(float(t), views, {"h:1": {"itl": Sample(9.0)}})
    drain = [d for d in out if d.action == "drain"]
    assert drain and not drain[0].allowed and "no routable" in drain[0].outcome


def test_policy_cap_by_fraction():
    p = Policy(cfg(max_unroutable_fraction=0.25), can_restart=False)
    views = [WorkerView(n, f"h:{i}", "decode") for i, n in enumerate("abc")]
    out = []
    for t in range(5):
        out += p.observe(float(t), views, {"h:0": {"itl": Sample(9.0)}})
    drain = [d for d in out if d.action == "drain"]
    assert drain and not drain[0].allowed and "max_unroutable_fraction" in drain[0].outcome


def test_policy_restart_needs_a_supervisor_and_repeated_restarts_isolate():
    p = Policy(cfg(), can_restart=False)
    out = run(p, [(t, {"h:1": {"unresponsive": Sample(1.0)}}) for t in (0.0, 0.5, 1.0)])
    restart = [d for _, d in out if d.action == "restart"]
    assert restart and not restart[0].allowed and "supervisor" in restart[0].outcome
    p = Policy(cfg(), can_restart=True)
    out = run(p, [(0.0, {"h:1": {"restarts": Sample(1.0)}}), (1.0, {"h:1": {"restarts": Sample(2.0)}}),
                  (2.0, {"h:1": {"restarts": Sample(3.0), "itl": Sample(9.0)}})])
    assert [d.action for _, d in out] == ["warn", "isolate"]
    assert p.state("h:1") == "isolated"
    later = run(p, [(t, {"h:1": {"itl": Sample(9.0), "unresponsive": Sample(1.0)}}) for t in range(3, 10)])
    assert [d.action for _, d in later if d.action != "warn"] == []  # nothing more about an isolated worker


def test_policy_escalates_a_drained_worker_to_a_restart_and_clears_when_healthy():
    p = Policy(cfg(), can_restart=True)
    out = run(p, [(t / 2, {"h:1": {"itl": Sample(5.0)}}) for t in range(0, 5)])
    assert [d.action for _, d in out] == ["warn", "drain"]
    out = run(p, [(12.0, {"h:1": {}})])  # no samples (no traffic) past escalate_s
    assert [d.action for _, d in out] == ["restart"] and p.state("h:1") == "restarting"
    out = run(p, [(13.0, {"h:1": {"unresponsive": Sample(0.0)}})])
    assert [d.action for _, d in out] == ["clear"] and p.state("h:1") == "ok"


def test_latency_shared_by_the_peers_is_no_regression():
    sig = WorkerSignals("decode", SignalConfig(span_s=1.0, latency_floor_s=0.001))
    count, total = 0, 0.0
    for i in range(40):
        t = i * 0.25
        step = 0.004 if t < 5 else 0.02  # everyone got 5x slower (more load)
        count, total = count + 10, total + 10 * step
        s = sig.update(t, healthy=True, scrape=page(t, count, total), starting=False, supervisor_restarts=0,
                       peer_step_s=step)
    assert s["itl"].value == pytest.approx(1.0)
    assert s["itl"].detail["peers_s"] == 0.02
