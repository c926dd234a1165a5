"""Loss-scale and GradScaler-usage rules (AMP-N01, N02, N03, N07, N08, N09, N10), the scaler
success-rate health metric, and the engine's threshold / not-checked contract.

Every case is a hand-built run; expected evidence is recomputed here from the planted data,
not read back from the rule.
"""

from __future__ import annotations

import dataclasses

import pytest

import amprobe
from amprobe.rules import REGISTRY, ThresholdError
from amprobe.rules import scaler as scaler_rules
from tests.helpers import fake_run
from tests.trajectories import (
    diag,
    findings_of,
    not_checked_ids,
    plain_steps,
    scaled_steps,
    scaler_event,
)

SCALER_RULES = {"AMP-N01", "AMP-N02", "AMP-N03", "AMP-N07", "AMP-N08", "AMP-N09", "AMP-N10"}


def test_every_scaler_rule_is_covered_here():
    registered = {
        rid for rid, spec in REGISTRY.items() if spec.fn.__module__ == scaler_rules.__name__
    }
    assert registered == SCALER_RULES


# -- AMP-N01 scale-backoff ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "cuts", "interval", "expected"),
    [
        pytest.param(100, [], 10, None, id="no-cut"),
        pytest.param(100, [40], 10, "info", id="one-cut-info"),
        pytest.param(100, list(range(1, 100, 10)), 10, "info", id="one-per-interval-boundary-info"),
        pytest.param(100, list(range(1, 100, 9)), 10, "warning", id="more-than-one-per-interval"),
        pytest.param(100, list(range(1, 40, 2)), 10, "warning", id="twenty-cuts-warning"),
    ],
)
def test_n01_scale_backoff(n, cuts, interval, expected):
    run = fake_run(
        steps=scaled_steps(n, cuts=cuts), events=[scaler_event(growth_interval=interval)]
    )
    found = findings_of(diag(run), "AMP-N01")
    if expected is None:
        assert found == []
        return
    assert len(found) == 1
    f = found[0]
    assert f.severity == expected
    assert f.evidence["cut_count"] == len(cuts)
    assert f.evidence["step_count"] == n
    assert f.evidence["cut_steps"] == sorted(cuts)[:20]
    assert f.evidence["growth_interval"] == interval
    assert f.evidence["calibration_cut_count"] == 0
    assert f.evidence["cuts_per_growth_interval"] == pytest.approx(
        len(cuts) / (n / interval), abs=1e-3
    )
    afters = [r["scale_after"] for r in scaled_steps(n, cuts=cuts)]
    assert f.evidence["min_scale"] == 65536.0 / 2 ** len(cuts) == min(afters)
    assert f.evidence["max_scale"] == max(afters)
    assert f.name == "scale-backoff" and f.category == "nan" and f.fix


@pytest.mark.parametrize(
    ("cuts", "expected", "calibration"),
    [
        pytest.param([0, 1, 2], "info", 3, id="only-calibration"),
        pytest.param([0, 1, 2, *range(10, 100, 5)], "warning", 3, id="calibration-then-frequent"),
        pytest.param([0, 1, 2, 50], "info", 3, id="calibration-then-rare"),
    ],
)
def test_n01_initial_calibration_is_not_judged(cuts, expected, calibration):
    run = fake_run(steps=scaled_steps(100, cuts=cuts), events=[scaler_event(growth_interval=10)])
    (f,) = findings_of(diag(run), "AMP-N01")
    assert f.severity == expected
    assert f.evidence["calibration_cut_count"] == calibration
    later = len(cuts) - calibration
    assert f.evidence["cuts_per_growth_interval"] == pytest.approx(later / (100 / 10), abs=1e-3)
    if later == 0:
        assert "initial calibration" in f.title


def test_n01_short_run_counts_at_least_one_interval():
    # 2 cuts (not at the start) in 50 steps with interval 2000: 2 per interval, a warning
    run = fake_run(
        steps=scaled_steps(50, cuts=[20, 30]), events=[scaler_event(growth_interval=2000)]
    )
    (f,) = findings_of(diag(run), "AMP-N01")
    assert f.evidence["cuts_per_growth_interval"] == pytest.approx(2.0)
    assert f.severity == "warning"


def test_n01_threshold_override_turns_warning_into_info():
    run = fake_run(
        steps=scaled_steps(100, cuts=range(1, 40, 2)), events=[scaler_event(growth_interval=10)]
    )
    assert findings_of(diag(run), "AMP-N01")[0].severity == "warning"
    relaxed = diag(run, {"AMP-N01": {"frequent_cuts_per_interval": 5.0}})
    assert findings_of(relaxed, "AMP-N01")[0].severity == "info"


def test_n01_uses_default_growth_interval_without_scaler_event():
    # 2 cuts in 4000 steps with torch's default growth_interval 2000 -> 1 per interval: info.
    run = fake_run(steps=scaled_steps(4000, cuts=[5, 6]))
    (f,) = findings_of(diag(run), "AMP-N01")
    assert f.evidence["growth_interval"] == 2000
    assert f.severity == "info"


# -- AMP-N02 skip-rate ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "skipped", "expected"),
    [
        pytest.param(100, 0, None, id="all-applied"),
        pytest.param(100, 5, None, id="95pct-boundary-none"),
        pytest.param(100, 6, "warning", id="94pct-warning"),
        pytest.param(100, 10, "warning", id="90pct-boundary-warning"),
        pytest.param(100, 11, "error", id="89pct-error"),
        pytest.param(20, 20, "error", id="all-skipped"),
        pytest.param(9, 9, None, id="below-min-steps"),
    ],
)
def test_n02_skip_rate(n, skipped, expected):
    cut_steps = list(range(n - skipped, n))  # skipped steps at the end; they still count as steps
    run = fake_run(steps=scaled_steps(n, cuts=cut_steps))
    found = findings_of(diag(run), "AMP-N02")
    if expected is None:
        assert found == []
        return
    (f,) = found
    assert f.severity == expected
    rate = (n - skipped) / n
    assert f.evidence["success_rate"] == pytest.approx(rate, abs=1e-4)
    assert f.evidence["skipped_count"] == skipped
    assert f.evidence["step_count"] == n
    assert f.evidence["skipped_steps"] == cut_steps[:20]
    assert (f.evidence["warn_below"], f.evidence["error_below"]) == (0.95, 0.90)


def test_n02_threshold_overrides_change_outcome():
    run = fake_run(steps=scaled_steps(100, cuts=range(50, 53)))  # 97 % applied
    assert findings_of(diag(run), "AMP-N02") == []
    (f,) = findings_of(diag(run, {"AMP-N02": {"warn_below": 0.98}}), "AMP-N02")
    assert f.severity == "warning"
    (f,) = findings_of(diag(run, {"AMP-N02": {"warn_below": 0.99, "error_below": 0.98}}), "AMP-N02")
    assert f.severity == "error"
    short = fake_run(steps=scaled_steps(8, cuts=range(4, 8)))
    assert findings_of(diag(short), "AMP-N02") == []
    assert findings_of(diag(short, {"AMP-N02": {"min_steps": 5}}), "AMP-N02")[0].severity == "error"


def test_n02_per_rank_evidence():
    rows = scaled_steps(50, rank=0) + scaled_steps(50, cuts=range(20, 30), rank=1)
    run = fake_run(steps=rows, ranks=(0, 1))
    (f,) = findings_of(diag(run), "AMP-N02")
    assert f.evidence["rank"] == 1
    assert f.evidence["success_rate"] == pytest.approx(0.8)
    assert "rank 1" in f.title


def test_n02_not_checked_on_bf16_run_without_scaler():
    run = fake_run(steps=plain_steps(50, dtype="bfloat16"))
    d = diag(run)
    reasons = not_checked_ids(d)
    assert "AMP-N02" in reasons and "GradScaler" in reasons["AMP-N02"]
    assert findings_of(d, "AMP-N02") == []


# -- AMP-N03 scale-collapse -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "cuts", "init", "expect", "run_len", "start", "below_at"),
    [
        pytest.param(40, [], 65536.0, False, 0, None, None, id="stable"),
        pytest.param(40, range(5, 20), 65536.0, False, 15, 5, None, id="15-consecutive-cuts"),
        pytest.param(40, range(5, 21), 65536.0, True, 16, 5, None, id="16-consecutive-cuts"),
        pytest.param(40, [3, 5, 7], 4.0, True, 1, 3, 7, id="scale-below-1"),
        pytest.param(40, [3, 4], 4.0, False, 2, 3, None, id="scale-exactly-1"),
    ],
)
def test_n03_scale_collapse(n, cuts, init, expect, run_len, start, below_at):
    run = fake_run(
        steps=scaled_steps(n, cuts=cuts, init=init), events=[scaler_event(init_scale=init)]
    )
    found = findings_of(diag(run), "AMP-N03")
    if not expect:
        assert found == []
        return
    (f,) = found
    assert f.severity == "error"
    assert f.evidence["min_scale"] == init / 2 ** len(list(cuts))
    assert f.evidence["consecutive_cut_count"] == run_len
    assert f.evidence["cut_run_starts_at_step"] == start
    assert f.evidence["first_step_below_min"] == below_at


def test_n03_threshold_override():
    run = fake_run(steps=scaled_steps(40, cuts=range(5, 13)))  # 8 consecutive cuts, scale 256
    assert findings_of(diag(run), "AMP-N03") == []
    assert findings_of(diag(run, {"AMP-N03": {"max_consecutive_cuts": 8}}), "AMP-N03")
    assert findings_of(diag(run, {"AMP-N03": {"min_scale": 512}}), "AMP-N03")


# -- AMP-N07 scale-chronically-low ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "cuts", "growth", "expect"),
    [
        pytest.param(50, range(10), [], True, id="stuck-1024x-low"),
        pytest.param(50, range(8), [], True, id="exactly-256x-low-boundary"),
        pytest.param(50, range(7), [], False, id="only-128x-low"),
        pytest.param(50, range(10), [45], False, id="grows-in-window"),
        pytest.param(39, range(10), [], False, id="shorter-than-window"),
        pytest.param(50, [], [], False, id="healthy"),
    ],
)
def test_n07_scale_chronically_low(n, cuts, growth, expect):
    interval, init = 10, 65536.0
    run = fake_run(
        steps=scaled_steps(n, cuts=cuts, growth=growth, init=init),
        events=[scaler_event(growth_interval=interval, init_scale=init)],
    )
    found = findings_of(diag(run), "AMP-N07")
    if not expect:
        assert found == []
        return
    (f,) = found
    final = init / 2 ** len(list(cuts))
    window = 4 * interval
    assert f.severity == "warning"
    assert f.evidence["final_scale"] == final
    assert f.evidence["init_scale"] == init
    assert f.evidence["no_growth_step_count"] == window
    assert f.evidence["window_cut_count"] == len([c for c in cuts if c >= n - window])


def test_n07_threshold_override():
    run = fake_run(steps=scaled_steps(50, cuts=range(7)), events=[scaler_event(growth_interval=10)])
    assert findings_of(diag(run), "AMP-N07") == []
    assert findings_of(diag(run, {"AMP-N07": {"below_init_factor": 64}}), "AMP-N07")
    assert (
        findings_of(
            diag(run, {"AMP-N07": {"below_init_factor": 64, "min_intervals": 6}}), "AMP-N07"
        )
        == []
    )


# -- AMP-N08 scaler-recreated ---------------------------------------------------------------------


def _resetting_steps(n: int, resets: list[int], init: float = 65536.0) -> list[dict]:
    """A scale cut every step, except that it restarts at ``init`` at the ``resets`` steps."""
    rows = scaled_steps(n, cuts=range(n), init=init)
    scale = init
    for row in rows:
        if row["step"] in resets:
            scale = init
        row["scale_before"], row["scale_after"] = scale, scale / 2
        scale /= 2
    return rows


@pytest.mark.parametrize(
    ("sites", "resets", "expect", "instances_at_site"),
    [
        pytest.param(["t.py:5"], [], False, None, id="one-scaler"),
        pytest.param(["t.py:5", "t.py:9"], [], False, None, id="two-sites-once-each"),
        pytest.param(["t.py:5", "t.py:20", "t.py:20", "t.py:20"], [], True, 3, id="built-in-loop"),
        pytest.param([None, None, "?", "?"], [], False, None, id="unknown-sites-ignored"),
        pytest.param(["t.py:5"], [10], False, None, id="one-reset-allowed"),
        pytest.param(["t.py:5"], [10, 20], True, 1, id="two-resets"),
    ],
)
def test_n08_scaler_recreated(sites, resets, expect, instances_at_site):
    events = [scaler_event(site=s, step=i) for i, s in enumerate(sites)]
    run = fake_run(steps=_resetting_steps(30, resets), events=events)
    found = findings_of(diag(run), "AMP-N08")
    if not expect:
        assert found == []
        return
    (f,) = found
    assert f.severity == "error"
    assert f.evidence["instance_count"] == len(sites)
    assert f.evidence["scale_reset_steps"] == resets
    assert f.evidence["site_instance_count"] == instances_at_site
    if instances_at_site and instances_at_site > 1:
        assert f.evidence["site"] == "t.py:20"
        assert f.evidence["created_at_steps"] == [i for i, s in enumerate(sites) if s == "t.py:20"]


def test_n08_threshold_override():
    events = [scaler_event(site="t.py:20", step=i) for i in range(3)]
    run = fake_run(steps=scaled_steps(30), events=events)
    assert findings_of(diag(run), "AMP-N08")
    assert findings_of(diag(run, {"AMP-N08": {"max_instances_per_site": 3}}), "AMP-N08") == []


# -- AMP-N09 clip-before-unscale ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_steps", "expect"),
    [
        pytest.param([], False, id="clips-after-unscale"),
        pytest.param([3], True, id="one-scaled-clip"),
        pytest.param(list(range(30)), True, id="every-step"),
    ],
)
def test_n09_clip_before_unscale(bad_steps, expect):
    rows = scaled_steps(30, clip_calls=1, unscale_calls=1)
    for row in rows:
        row["clip_scaled"] = 1 if row["step"] in bad_steps else 0
    events = [
        {"kind": "clip_before_unscale", "step": s, "function": "clip_grad_norm_", "site": "t.py:7"}
        for s in bad_steps
    ]
    found = findings_of(diag(fake_run(steps=rows, events=events)), "AMP-N09")
    if not expect:
        assert found == []
        return
    (f,) = found
    assert f.severity == "error"
    assert f.evidence["affected_step_count"] == len(bad_steps)
    assert f.evidence["step_count"] == 30
    assert f.evidence["clipped_steps"] == bad_steps[:20]
    assert f.evidence["functions"] == ["clip_grad_norm_"]
    assert f.evidence["call_sites"] == ["t.py:7"]


def test_n09_null_clip_column_and_override():
    assert findings_of(diag(fake_run(steps=scaled_steps(30))), "AMP-N09") == []  # clip_scaled null
    rows = scaled_steps(30)
    for row in rows[:3]:
        row["clip_scaled"] = 1
    run = fake_run(steps=rows)
    assert findings_of(diag(run), "AMP-N09")
    assert findings_of(diag(run, {"AMP-N09": {"max_scaled_clips": 3}}), "AMP-N09") == []


def test_n09_also_checked_without_scaler():
    rows = plain_steps(10, clip_scaled=1)
    assert findings_of(diag(fake_run(steps=rows)), "AMP-N09")


# -- AMP-N10 scaler-not-restored ------------------------------------------------------------------

OPT_SEEN = {
    "kind": "optimizer_seen",
    "optimizer_class": "AdamW",
    "trainable_params": 10,
    "trainable_half_params": 0,
}


@pytest.mark.parametrize(
    ("events", "expect"),
    [
        pytest.param([], False, id="fresh-run"),
        pytest.param([{"kind": "optimizer_state_loaded"}], True, id="resume-without-scaler"),
        pytest.param(
            [{"kind": "optimizer_state_loaded"}, {"kind": "scaler_state_loaded", "empty": True}],
            True,
            id="scaler-loaded-empty-state",
        ),
        pytest.param(
            [{"kind": "optimizer_state_loaded"}, {"kind": "scaler_state_loaded", "empty": False}],
            False,
            id="resume-with-scaler",
        ),
        pytest.param([{"kind": "scaler_state_loaded", "empty": False}], False, id="scaler-only"),
    ],
)
def test_n10_scaler_not_restored(events, expect):
    cuts = [0, 1, 2, 25]
    run = fake_run(steps=scaled_steps(30, cuts=cuts), events=[OPT_SEEN, scaler_event(), *events])
    found = findings_of(diag(run), "AMP-N10")
    if not expect:
        assert found == []
        return
    (f,) = found
    assert f.severity == "warning"
    assert f.evidence["optimizer_load_count"] == 1
    assert f.evidence["early_skipped_count"] == 3
    assert f.evidence["first_scale"] == 65536.0
    assert f.evidence["init_scale"] == 65536.0


def test_n10_not_checked_without_optimizer():
    run = fake_run(steps=scaled_steps(30), events=[{"kind": "optimizer_state_loaded"}])
    assert "AMP-N10" in not_checked_ids(diag(run))


# -- health: scaler success rate ------------------------------------------------------------------


@pytest.mark.parametrize(("n", "skipped"), [(10, 0), (40, 3), (7, 7)])
def test_health_scaler_success_rate(n, skipped):
    run = fake_run(steps=scaled_steps(n, cuts=range(skipped)))
    metric = diag(run).health["scaler_success_rate"]
    assert metric["value"] == pytest.approx((n - skipped) / n)
    assert metric["step_count"] == n and metric["skipped_count"] == skipped


def test_health_success_rate_without_scaler_or_steps():
    d = diag(fake_run(steps=plain_steps(10, dtype="bfloat16")))
    assert d.health["scaler_success_rate"]["value"] is None
    assert "not applicable" in d.health["scaler_success_rate"]["note"]
    empty = diag(fake_run())
    assert empty.health["scaler_success_rate"]["value"] is None
    assert "not measured" in empty.health["scaler_success_rate"]["note"]
    for metric in ("speedup", "memory_ratio", "loss_diff", "mfu"):
        assert empty.health[metric]["value"] is None and empty.health[metric]["note"]


# -- engine contract ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"AMP-X99": {"warn_below": 0.5}},
        {"AMP-N02": {"no_such_threshold": 1.0}},
        {"AMP-N10": {"anything": 1.0}},  # a rule without thresholds
    ],
)
def test_unknown_rule_or_threshold_raises(overrides):
    with pytest.raises(ThresholdError):
        amprobe.diagnose(fake_run(steps=scaled_steps(20)), thresholds=overrides)


def test_overrides_do_not_leak_into_defaults():
    run = fake_run(steps=scaled_steps(100, cuts=range(50, 53)))
    assert findings_of(diag(run, {"AMP-N02": {"warn_below": 0.99}}), "AMP-N02")
    assert findings_of(diag(run), "AMP-N02") == []
    assert REGISTRY["AMP-N02"].thresholds["warn_below"] == 0.95


def test_empty_run_lists_every_rule_as_not_checked():
    d = diag(fake_run())
    assert d.findings == ()
    reasons = not_checked_ids(d)
    assert set(reasons) == set(REGISTRY)
    assert all(reason for reason in reasons.values())


def test_a_raising_rule_becomes_not_checked(monkeypatch):
    def broken(ctx):
        raise KeyError("boom")

    spec = REGISTRY["AMP-N02"]
    monkeypatch.setitem(REGISTRY, "AMP-N02", dataclasses.replace(spec, fn=broken))
    run = fake_run(
        steps=scaled_steps(100, cuts=range(0, 40, 2)), events=[scaler_event(growth_interval=10)]
    )
    d = amprobe.diagnose(run)
    reasons = not_checked_ids(d)
    assert "KeyError" in reasons["AMP-N02"] and "rule failed" in reasons["AMP-N02"]
    assert "AMP-N02" not in d.ids()
    assert "AMP-N01" in d.ids()  # the other rules still ran


def test_findings_listed_cause_first_and_serialisable():
    """A scaler built anew restarts the scale (AMP-N08, error): it explains the cuts (N01),
    the skipped steps (N02, error) and the overflow (N11), so it comes before them, though by
    severity and ID N02 would come first; the findings without a cause are in severity order."""
    events = [scaler_event(site="t.py:5", step=0)]
    d = diag(fake_run(steps=_resetting_steps(30, [10, 20]), events=events))
    ids = d.ids()
    assert {"AMP-N01", "AMP-N02", "AMP-N08"} <= set(ids)
    assert ids.index("AMP-N08") < ids.index("AMP-N02") < ids.index("AMP-N01")
    for i, f in enumerate(d.findings):  # every present cause stands above its symptom
        assert all(ids.index(c) < i for c in f.explained_by), f.id
    assert d.findings[ids.index("AMP-N02")].explained_by == ("AMP-N08",)
    order = {"error": 0, "warning": 1, "info": 2}
    roots = [order[f.severity] for f in d.findings if not f.explained_by]
    assert roots == sorted(roots) and d.worst() == "error"
    payload = d.to_dict()
    assert [f["id"] for f in payload["findings"]] == ids


#: the rules that judge the script's own AMP setup (autocast regions, GradScaler): on the FP32
#: leg of `amprobe baseline` amprobe turned both off, so they are not checked there
FORCED_FP32_RULES = {
    "AMP-N01",
    "AMP-N02",
    "AMP-N03",
    "AMP-N06",
    "AMP-N07",
    "AMP-N08",
    "AMP-N09",
    "AMP-N10",
    "AMP-N11",
    "AMP-N12",
    "AMP-N15",
    "AMP-S05",
    "AMP-S06",
    "AMP-S07",
    "AMP-D01",
}


def test_forced_fp32_leg_does_not_judge_the_scripts_amp_setup():
    """The FP32 leg of `amprobe baseline`: amprobe disabled the script's GradScaler, so an
    autocast region it did not reach must not read as "fp16 without a scaler" (AMP-N12), and
    no AMP rule says more than "not checked" with the reason."""
    steps = plain_steps(20, dtype="float16", loss_dtype="float16")
    events = [scaler_event(enabled=False)]
    as_written = diag(fake_run(steps=steps, events=events))
    assert "AMP-N12" in as_written.ids()  # the same record, not forced: the rule judges it
    forced = diag(fake_run(steps=steps, events=events, manifest={"forced_fp32": True}))
    reasons = not_checked_ids(forced)
    why = "the FP32 leg of `amprobe baseline` (amprobe forced fp32)"
    assert {rid for rid, reason in reasons.items() if reason == why} == FORCED_FP32_RULES
    assert not FORCED_FP32_RULES & set(forced.ids())
    assert "AMP-N13" in forced.ids()  # the script's own half loss is still reported


# -- the initial calibration, one notion for every rule (issue 19 item 3) -------------------------


def _calibrating_run(n: int = 30, cuts=(0, 1, 2), init: float = 65536.0, **manifest):
    return fake_run(
        steps=scaled_steps(n, cuts=cuts, init=init),
        events=[scaler_event(growth_interval=2000, init_scale=65536.0)],
        manifest={"bf16_supported": True, "device": "cpu", **manifest},
    )


def test_initial_calibration_is_judged_by_no_rule():
    """3 skipped first steps while the scale comes down from init_scale: AMP-N01 reports them
    as calibration; before, AMP-N02 (90.0 % of 30 steps) and AMP-N11 (3 cuts) warned too."""
    d = diag(_calibrating_run())
    (n01,) = findings_of(d, "AMP-N01")
    assert n01.severity == "info" and "initial calibration" in n01.title
    assert n01.evidence["calibration_cut_count"] == 3
    assert findings_of(d, "AMP-N02") == []
    assert findings_of(d, "AMP-N11") == []


def test_cuts_after_the_calibration_are_judged_without_it():
    # 3 calibration cuts, then 3 overflows in 27 steps: 88.9 % of the judged steps applied
    d = diag(_calibrating_run(cuts=(0, 1, 2, 10, 15, 20)))
    (n02,) = findings_of(d, "AMP-N02")
    assert n02.severity == "error"
    assert n02.evidence["step_count"] == 27 and n02.evidence["skipped_count"] == 3
    assert n02.evidence["calibration_step_count"] == 3
    assert n02.evidence["skipped_steps"] == [10, 15, 20]
    assert "3 step(s) of initial calibration not judged" in n02.title
    (n11,) = findings_of(d, "AMP-N11")
    assert n11.evidence["scale_cut_count"] == 3
    assert n11.evidence["skipped_share"] == pytest.approx(3 / 27, abs=1e-4)
    assert "not counting 3 step(s) of initial calibration" in n11.title


@pytest.mark.parametrize(
    ("cuts", "init", "calibration"),
    [
        pytest.param((0, 1, 2), 65536.0, 3, id="calibration"),
        pytest.param((0, 1, 2), 1024.0, 0, id="not-at-init-scale"),  # a resumed or attached run
        pytest.param(range(16), 65536.0, 0, id="16-cuts-are-a-collapse"),
        pytest.param(range(15), 65536.0, 15, id="15-cuts"),
        pytest.param((1, 2), 65536.0, 0, id="not-at-the-start"),
    ],
)
def test_what_counts_as_calibration(cuts, init, calibration):
    d = diag(_calibrating_run(n=60, cuts=cuts, init=init))
    (n01,) = findings_of(d, "AMP-N01")
    assert n01.evidence["calibration_cut_count"] == calibration
    n02 = findings_of(d, "AMP-N02")
    assert bool(n02) == (calibration == 0 and len(list(cuts)) > 3)


def test_no_calibration_without_a_known_init_scale():
    run = fake_run(steps=scaled_steps(30, cuts=(0, 1, 2)))  # no scaler_created event
    (n01,) = findings_of(diag(run), "AMP-N01")
    assert n01.evidence["calibration_cut_count"] == 0
    assert findings_of(diag(run), "AMP-N02")[0].evidence["calibration_step_count"] == 0


def test_n09_counts_the_steps_that_observed_clipping():
    """Clipping is a detail (recorded on every 10th step): the share is of the steps that
    observed it, not of all steps."""
    rows = scaled_steps(30, clip_calls=1, unscale_calls=1)
    for row in rows:
        observed = row["step"] == 0 or (row["step"] + 1) % 10 == 0
        row["clip_scaled"] = 1 if observed else None
        row["clip_calls"] = 1 if observed else None
    (f,) = findings_of(diag(fake_run(steps=rows)), "AMP-N09")
    assert f.evidence["affected_step_count"] == 4 and f.evidence["observed_step_count"] == 4
    assert f.evidence["step_count"] == 30
    assert f.title == "gradients clipped while still scaled in 4 of 4 steps observed"
