"""Report section for the precision what-if: exponent-range heatmaps and the per-layer table."""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pandas as pd

from amprobe.analysis.frames import section_keys, steps_text
from amprobe.analysis.numerics import class_representatives, layer_histograms
from amprobe.analysis.whatif import (
    FORMATS,
    KINDS,
    SCALINGS,
    compute_exponent_shares,
    compute_exponent_shares_summaries,
    compute_whatif,
    compute_whatif_frame,
    layer_order,
    not_judged_text,
    summary_layer_order,
)
from amprobe.report.blockfit import block_fit_text, make_block_fit_figure, run_block_fit
from amprobe.report.registry import Section, section
from amprobe.report.scale import many_ranks, many_relations
from amprobe.rules.engine import REGISTRY

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run


__all__ = [
    "HEATMAP_GROUPS",
    "FORMAT_COLORS",
    "make_exponent_heatmap",
    "make_run_exponent_heatmap",
    "heatmap_groups",
    "whatif_table",
    "whatif_headline",
    "build_whatif_section",
]

#: heatmap name -> (title, numerics kinds, fp8 format whose per-tensor window is drawn per row)
HEATMAP_GROUPS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "activations": ("activations (layer outputs)", ("output",), "e4m3"),
    "gradients": ("gradients (unscaled)", ("grad_output", "grad_param"), "e5m2"),
}
#: line colour and dash of each format's window
FORMAT_COLORS: dict[str, tuple[str, str]] = {
    "fp16": ("#1565c0", "solid"),
    "bf16": ("#2e7d32", "dot"),
    "e4m3": ("#c62828", "dash"),
    "e5m2": ("#ef6c00", "dashdot"),
}
_KIND_SUFFIX = {"output": "", "grad_output": " · output grad", "grad_param": " · param grad"}
_MIN_LOG_SHARE = -6.0
#: the rule whose threshold says what "a layer keeps its values" means in the headline
KEEP_RULE, KEEP_THRESHOLD = "AMP-P01", "min_representable_share"
#: not-judged layers named per group of steps in the headline (the rest are counted)
MAX_NAMED = 8
#: what a lost % cell of a layer that held inf/NaN says
NOT_JUDGED = "not judged"
MISSING = "no per-layer exponent histogram was recorded (the numerics table is empty)"
TOLERANCE = (
    "Shares come from exponent-only histograms and classify values as a round-to-nearest cast "
    "does (overflow from the max plus half a step: fp16 65520; flush at or below half the min "
    "subnormal). Overflow and flush-to-zero are exact except in the edge binades (the binade "
    "from half the min subnormal, whose exact ties flush; the binade holding the max when amax "
    "reaches the overflow bound; fp32 values below 2^-133, whose binade is not resolved); "
    "subnormal shares are upper bounds but for those fp32 values (the last binade below the "
    "min normal partly rounds up). The edge_share column bounds the error; per-tensor scaling is "
    "the power of two that maps each step's amax just under the format max; gradients are "
    "measured after the loss scale was removed."
)


def _labels(frame: pd.DataFrame) -> pd.Series:
    return frame["module"].astype(str) + frame["kind"].map(_KIND_SUFFIX).fillna("")


#: what a missing row of a kind says on hover (the layer's other kinds were recorded)
NOT_MEASURED: dict[str, str] = {
    "output": "no activation histogram was recorded for this layer at any sampled step",
    "grad_output": "no output-gradient histogram was recorded for this layer at any sampled "
    "step (no gradient reached its output, or its backward was not hooked)",
}
#: cell colours of the rows that are not drawn by share
GREY = "#9e9e9e"
LIGHT_GREY = "#d9d9d9"
RED = "#c62828"


def _layer_facts(
    order: dict[str, int], seen: set[tuple[str, str]], wf: pd.DataFrame, kinds: tuple[str, ...]
) -> pd.DataFrame:
    """Per (module, kind) the heatmap could show, in forward execution order (``order``:
    :func:`~amprobe.analysis.whatif.layer_order`): ``status`` (``judged``, ``not judged``,
    ``zeros`` or ``not measured``), ``nonfinite``, ``nonfinite_steps``, ``nonzero`` and, for
    ``not measured``, ``reason``.

    A kind is expected for a layer when it was recorded for it, or (``output``) when the layer
    was recorded at all, or (``grad_output``) when its output was recorded (``seen``: the
    recorded (module, kind) pairs); parameter gradients only where recorded (a layer without
    parameters has none).
    """
    per = wf.drop_duplicates(["rank", "module", "kind"])
    per = per.assign(module=per["module"].astype(str), kind=per["kind"].astype(str))
    facts = per.groupby(["module", "kind"], sort=False).agg(
        nonfinite=("nonfinite", "sum"),
        nonzero=("nonzero", "sum"),
        nonfinite_steps=("nonfinite_steps", lambda s: sorted({x for v in s for x in v})),
    )
    rows = []
    for module in order:
        for kind in kinds:
            if (module, kind) in facts.index:
                f = facts.loc[(module, kind)]
                status = (
                    "not judged"
                    if f["nonfinite"] > 0
                    else ("judged" if f["nonzero"] > 0 else "zeros")
                )
                rows.append((module, kind, status, int(f["nonfinite"]), f["nonfinite_steps"], ""))
                continue
            expected = (kind == "output" and (module, kind) not in seen) or (
                kind == "grad_output" and (module, "output") in seen
            )
            if expected and kind in NOT_MEASURED:
                rows.append((module, kind, "not measured", 0, [], NOT_MEASURED[kind]))
    cols = ["module", "kind", "status", "nonfinite", "nonfinite_steps", "reason"]
    out = pd.DataFrame(rows, columns=cols)
    return out.assign(label=_labels(out).map(html.escape))


def _flat(color: str) -> list[list[Any]]:
    return [[0, color], [1, color]]


def make_exponent_heatmap(
    numerics: pd.DataFrame, group: str = "activations", whatif: pd.DataFrame | None = None
) -> go.Figure:
    """Layers (execution order) x base-2 exponent, colour = share of the layer's values.

    Shares are of each layer's nonzero finite values summed over the sampled steps (named in
    the title); a cell with no values is white. Rows not drawn by share: a layer and kind that
    held inf/NaN is not judged (its finite values in grey, the hover names the steps), a kind
    that was not recorded for a layer whose other kinds were is "not measured" (a light grey
    row, the reason on hover), one that held only zeros says so on hover. A last column,
    ``inf/NaN``, is red for every row that held inf/NaN.

    Outlined on top: the representable windows (min subnormal .. max) of fp16, bf16, e4m3 and
    e5m2 cast as-is, with a dotted line at each min normal; per judged row, a black segment
    marks the fp8 window (e4m3 for activations, e5m2 for gradients) after that layer's
    per-tensor scale (last sampled step). Layer names are HTML-escaped in axis and hover text.

    Args:
        numerics: a ``numerics`` table.
        group: a :data:`HEATMAP_GROUPS` key.
        whatif: :func:`amprobe.analysis.whatif.compute_whatif_frame` of ``numerics`` (computed
            when not given), for the per-row scaled windows and the inf/NaN of each row.
    """
    kinds = HEATMAP_GROUPS[group][1]
    shares = compute_exponent_shares(numerics, kinds)
    wf = whatif if whatif is not None else compute_whatif_frame(numerics)
    seen = set(zip(numerics["module"].astype(str), numerics["kind"].astype(str), strict=True))
    sampled = numerics.loc[numerics["kind"].isin(list(kinds)), "step"].dropna().unique()
    return _exponent_heatmap(
        group, shares, wf, lambda: layer_order(numerics), seen, steps_text(sampled, word=True)
    )


def make_run_exponent_heatmap(
    run: Run, group: str = "activations", whatif: pd.DataFrame | None = None
) -> go.Figure:
    """:func:`make_exponent_heatmap` of a run's ``numerics`` table: of the table itself for a
    run of few ranks; for one of more than :data:`~amprobe.report.scale.MAX_RANK_LINES` ranks
    from the ranks' summaries (summed histograms, layer order, recorded layers: the same
    figure) and its derived store (the sampled steps named in the title), never the merged
    table.

    Args:
        run: the run.
        group: a :data:`HEATMAP_GROUPS` key.
        whatif: :func:`~amprobe.analysis.whatif.compute_whatif` of the run (computed when not
            given).
    """
    if not many_ranks([info.rank for info in run.ranks]):
        return make_exponent_heatmap(run.table("numerics"), group, whatif)
    kinds = HEATMAP_GROUPS[group][1]
    summaries = run.summaries()
    histograms = layer_histograms(run)
    # the order of the lowest rank of each class of equal sections is every rank's order
    reps = class_representatives(summaries, section_keys(run, "numerics"))
    order = run.cached(
        "summary_layer_order", lambda r: summary_layer_order({k: summaries[k] for k in reps})
    )
    shares = compute_exponent_shares_summaries(histograms, order, kinds)
    wf = whatif if whatif is not None else compute_whatif(run)
    seen = {(str(m), str(k)) for m, k in histograms.keys}
    return _exponent_heatmap(group, shares, wf, lambda: order, seen, _sampled_text(run, kinds))


def heatmap_groups(run: Run) -> list[str]:
    """The :data:`HEATMAP_GROUPS` the run has ``numerics`` rows for (from the ranks'
    summaries at many ranks)."""
    if not many_ranks([info.rank for info in run.ranks]):
        numerics = run.table("numerics")
        if numerics.empty:
            return []
        kinds = set(numerics["kind"].dropna().unique())
    else:
        kinds = {str(kind) for _, kind in layer_histograms(run).keys}
    return [g for g, (_, wanted, _) in HEATMAP_GROUPS.items() if kinds & set(wanted)]


def _sampled_text(run: Run, kinds: tuple[str, ...]) -> str:
    """``steps 0–9, 100`` of the steps at which some rank sampled a row of ``kinds`` (one
    ``GROUP BY kind, step`` in the derived store, kept per run)."""

    def read(r: Run) -> pd.DataFrame | str:
        try:
            rel = many_relations(r)["numerics"]
            sql = "SELECT kind, step FROM s WHERE step IS NOT NULL GROUP BY kind, step"
            return rel.query("s", sql).df()  # type: ignore[no-any-return]
        except OSError as exc:  # neither the run folder nor the user cache can be written
            return f"{type(exc).__name__}: {exc}"

    found = run.cached("numerics_kind_steps", read)
    if isinstance(found, str):
        return f"the sampled steps (not named: the derived store could not be read, {found})"
    return steps_text(found.loc[found["kind"].isin(list(kinds)), "step"], word=True)


def _exponent_heatmap(
    group: str,
    shares: pd.DataFrame,
    wf: pd.DataFrame,
    order: Callable[[], dict[str, int]],
    seen: set[tuple[str, str]],
    sampled: str,
) -> go.Figure:
    """:func:`make_exponent_heatmap` of :func:`compute_exponent_shares`' ``shares``, the
    what-if frame, the layer order (computed when needed), the recorded (module, kind) pairs
    and the sampled steps as text (``steps 0–9``)."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    title, kinds, scaled_fmt = HEATMAP_GROUPS[group]
    # the columns read, before the rows are picked (a what-if frame of thousands of ranks has
    # hundreds of thousands of rows)
    in_group = wf["kind"].isin(list(kinds)).to_numpy(dtype=bool)
    facts_columns = ["rank", "module", "kind", "nonfinite", "nonzero", "nonfinite_steps"]
    picked = wf.loc[in_group, facts_columns] if len(wf) else wf
    facts = (
        _layer_facts(order(), seen, picked, kinds)
        if len(picked)
        else pd.DataFrame(columns=["label", "status"])
    )
    fig = go.Figure()
    if shares.empty and (facts.empty or (facts["status"] == "not measured").all()):
        fig.update_layout(
            title=f"Exponent range of {title}: not recorded",
            annotations=[
                {
                    "text": f"no {title} were sampled",
                    "showarrow": False,
                    "xref": "paper",
                    "yref": "paper",
                    "x": 0.5,
                    "y": 0.5,
                }
            ],
        )
        return fig
    shares = shares.assign(label=_labels(shares).map(html.escape))
    rows = list(dict.fromkeys([*facts["label"], *shares["label"]]))
    status = dict(zip(facts["label"], facts["status"], strict=True))
    lo = int(min(shares["exponent"].min(), -26)) - 1 if len(shares) else -27
    hi = int(max(shares["exponent"].max(), 16)) + 1 if len(shares) else 17
    exps = list(range(lo, hi + 1))
    z = pd.DataFrame(float("nan"), index=rows, columns=exps)
    grey = pd.DataFrame(float("nan"), index=rows, columns=exps)
    text = pd.DataFrame("", index=rows, columns=exps)
    held = {
        r.label: not_judged_text(r.label, r.nonfinite_steps) + f" ({r.nonfinite:,} inf/NaN values)"
        for r in facts.itertuples()
        if r.status == "not judged"
    }
    for r in shares.itertuples():
        cell = (
            f"{r.label}<br>2^{r.exponent} ≤ |x| < 2^{r.exponent + 1}<br>"
            f"{r.share:.3%} of values ({r.count:,})"
        )
        if r.label in held:
            grey.loc[r.label, r.exponent] = 1.0
            text.loc[r.label, r.exponent] = f"{held[r.label]}<br>of its finite values:<br>{cell}"
            continue
        z.loc[r.label, r.exponent] = math.log10(r.share) if r.share > 0 else _MIN_LOG_SHARE
        text.loc[r.label, r.exponent] = cell
    ticks = list(range(int(_MIN_LOG_SHARE), 1))
    fig.add_trace(
        go.Heatmap(
            z=z.clip(lower=_MIN_LOG_SHARE).to_numpy(),
            x=exps,
            y=rows,
            text=text.to_numpy(),
            hoverinfo="text",
            colorscale="Viridis",
            zmin=_MIN_LOG_SHARE,
            zmax=0,
            colorbar={
                "title": "share",
                "tickvals": ticks,
                "ticktext": [f"{10.0**t:.0e}" if t < -2 else f"{10.0**t:.0%}" for t in ticks],
            },
            name="share of values",
        )
    )
    # rows not drawn by share: not judged (grey, over its finite values), not measured and
    # zeros-only (a whole row, light grey or white)
    for label, s in status.items():
        if s == "not measured" or s == "zeros":
            grey.loc[label, :] = 0.0 if s == "not measured" else -1.0
            reason = facts.loc[facts["label"] == label, "reason"].iloc[0]
            text.loc[label, :] = (
                f"{label}: not measured, {reason}"
                if s == "not measured"
                else f"{label}: every recorded value was exactly 0 (nothing to cast)"
            )
        elif s == "not judged" and grey.loc[label].isna().all():
            grey.loc[label, :] = 0.0  # only inf/NaN recorded: no finite value to place
            text.loc[label, :] = held[label]
    if grey.notna().any().any():
        fig.add_trace(
            go.Heatmap(
                z=grey.to_numpy(),
                x=exps,
                y=rows,
                text=text.to_numpy(),
                hoverinfo="text",
                colorscale=[[0, "white"], [0.5, LIGHT_GREY], [1, GREY]],
                zmin=-1,
                zmax=1,
                showscale=False,
                name="not judged (held inf/NaN) or not measured",
            )
        )
    # the inf/NaN column, right of the exponents
    bad = [held.get(label) for label in rows]
    inf_x = hi + 2
    fig.add_trace(
        go.Heatmap(
            z=[[1.0] if b else [float("nan")] for b in bad],
            x=[inf_x],
            y=rows,
            text=[[b or ""] for b in bad],
            hoverinfo="text",
            colorscale=_flat(RED),
            zmin=0,
            zmax=1,
            showscale=False,
            name="held inf/NaN",
        )
    )
    # per-row scaled fp8 window, for the rows judged
    fmt = FORMATS[scaled_fmt]
    sel = wf.loc[
        in_group
        & (wf["format"] == scaled_fmt).to_numpy(dtype=bool)
        & (wf["scaling"] == "per-tensor").to_numpy(dtype=bool),
        ["module", "kind", "scale_exp"],
    ]
    if len(sel):
        sel = sel.groupby(["module", "kind"], sort=False)["scale_exp"].last().reset_index()
        labels = _labels(sel).map(html.escape)
        xs: list[Any] = []
        ys: list[Any] = []
        for label, k in zip(labels, sel["scale_exp"], strict=True):
            if status.get(label, "judged") == "judged" and label in rows:
                xs += [fmt.min_subnormal_exp - int(k) - 0.5, fmt.top_exp - int(k) + 0.5, None]
                ys += [label, label, None]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                line={"color": "black", "width": 2},
                name=f"{fmt.label} window with per-tensor scaling",
                hoverinfo="skip",
            )
        )
    # as-is windows of every format, over the heatmap
    for name, f in FORMATS.items():
        color, dash = FORMAT_COLORS[name]
        x0 = max(f.min_subnormal_exp - 0.5, lo - 0.5)
        x1 = min(f.top_exp + 0.5, hi + 0.5)
        fig.add_vrect(
            x0=x0,
            x1=x1,
            line={"color": color, "dash": dash, "width": 2},
            fillcolor="rgba(0,0,0,0)",
        )
        if lo < f.min_normal_exp - 0.5 < hi:
            fig.add_vline(
                x=f.min_normal_exp - 0.5, line={"color": color, "dash": "dot", "width": 1}
            )
        clipped = " (beyond the axis)" if x0 > f.min_subnormal_exp - 0.5 else ""
        fig.add_trace(  # a legend entry naming the window drawn by the shapes
            go.Scatter(
                x=[None],
                y=[None],
                mode="lines",
                line={"color": color, "dash": dash, "width": 2},
                name=(
                    f"{f.label} as-is: 2^{f.min_subnormal_exp} … {f.max:.5g}, normal from "
                    f"2^{f.min_normal_exp}{clipped}"
                ),
            )
        )
    tickvals = [e for e in exps if e % 8 == 0] + [inf_x]
    fig.update_layout(
        title={
            "text": f"Exponent range of {title} per layer, with each format's window"
            f"<br><sup>summed over sampled {sampled}; grey: not judged "
            "(held inf/NaN) or not measured</sup>"
        },
        xaxis={
            "title": "base-2 exponent of |x| (bin e holds 2^e ≤ |x| < 2^(e+1))",
            "tickvals": tickvals,
            "ticktext": [str(e) for e in tickvals[:-1]] + ["inf/NaN"],
            "range": [lo - 0.5, inf_x + 0.5],
        },
        yaxis={"autorange": "reversed", "type": "category"},
        plot_bgcolor="white",
        height=max(360, 22 * len(rows) + 260),
        margin={"t": 160},
        legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
    )
    return fig


def whatif_table(whatif: pd.DataFrame) -> pd.DataFrame:
    """One row per layer and kind: range and lost (overflow + flush) % per format and scaling.

    A layer and kind that held inf/NaN is not judged: its lost % cells say ``not judged`` and
    its ``inf/NaN`` cell names the sampled steps at which it held them.
    """
    if whatif.empty:
        return pd.DataFrame()
    keys = ["rank", "module", "kind"]
    facts = ["dtype", "min_exp", "max_exp", "nonzero", "judged", "nonfinite", "nonfinite_steps"]
    base = whatif.drop_duplicates(keys)[[*keys, *facts]].reset_index(drop=True)
    # unstack keeps the null shares of layers not judged (pivot_table would drop them)
    wide = (
        whatif.assign(col=whatif["format"] + " " + whatif["scaling"] + " lost %")
        .drop_duplicates([*keys, "col"])
        .set_index([*keys, "col"])["lost_share"]
        .unstack("col")
    )
    wide = (wide * 100).round(4).reindex(pd.MultiIndex.from_frame(base[keys]))
    cols = [c for c in (f"{f} {s} lost %" for f in FORMATS for s in SCALINGS) if c in wide]
    wide = wide[cols].reset_index(drop=True).astype(object)
    judged = base["judged"].astype(bool).to_numpy()
    wide.loc[~judged, :] = NOT_JUDGED
    out = pd.concat([base[[*keys, "dtype", "min_exp", "max_exp", "nonzero"]], wide], axis=1)
    # the steps as text once per distinct list (the ranks of many share theirs)
    texts: dict[tuple[int, ...], str] = {}
    for steps in base["nonfinite_steps"][~judged]:
        key = tuple(steps)
        if key not in texts:
            texts[key] = steps_text(steps, word=True)
    out["inf/NaN"] = [
        "0" if ok else f"{int(n):,} at {texts[tuple(steps)]}: not judged"
        for ok, n, steps in zip(judged, base["nonfinite"], base["nonfinite_steps"], strict=True)
    ]
    out["kind"] = out["kind"].map(KINDS).fillna(out["kind"])
    if out["rank"].nunique() == 1:
        out = out.drop(columns="rank")
    return out


def _names(modules: list[str]) -> str:
    """``a, b and c``, at most :data:`MAX_NAMED` named."""
    if len(modules) > MAX_NAMED + 1:  # "and 1 more" would be longer than the name
        return ", ".join(modules[:MAX_NAMED]) + f" and {len(modules) - MAX_NAMED} more"
    return modules[0] if len(modules) == 1 else ", ".join(modules[:-1]) + " and " + modules[-1]


def keep_share(diagnosis: Diagnosis | None = None) -> float:
    """The share of its values a layer must keep in fp8 to count as keeping them: AMP-P01's
    ``min_representable_share``, as the diagnosis ran it (a configured value) or registered."""
    if diagnosis is not None and KEEP_RULE in diagnosis.thresholds:
        return float(diagnosis.thresholds[KEEP_RULE][KEEP_THRESHOLD])
    return float(REGISTRY[KEEP_RULE].thresholds[KEEP_THRESHOLD])


def whatif_headline(whatif: pd.DataFrame, keep: float | None = None) -> list[str]:
    """Per fp8 kind: how many judged layers keep their values; the not-judged layers, named.

    A layer keeps its values when it keeps at least ``keep`` of them (AMP-P01's threshold,
    :func:`keep_share`, when not given). A layer and kind that held inf/NaN is left out of the
    count and named with the sampled steps at which it held them (``booster: not judged, held
    inf/NaN at steps 120–129``).
    """
    keep = keep_share() if keep is None else keep
    lost = 1.0 - keep
    text = []
    scaled = whatif[whatif["scaling"] == "per-tensor"]
    for kind, fmt in (("output", "e4m3"), ("grad_output", "e5m2")):
        rows = scaled[(scaled["kind"] == kind) & (scaled["format"] == fmt)]
        if not len(rows):
            continue
        # one entry per layer over the ranks: judged on every rank, its worst loss, every step
        part = rows.groupby("module", sort=False).agg(
            judged=("judged", "all"),
            lost_share=("lost_share", "max"),
            nonfinite_steps=("nonfinite_steps", lambda s: sorted({x for v in s for x in v})),
        )
        part = part.reset_index()
        judged = part[part["judged"].astype(bool)]
        skipped = part[~part["judged"].astype(bool)]
        what = f"{KINDS[kind]}s in {FORMATS[fmt].label} with per-tensor scaling"
        if len(judged):
            fit = int((judged["lost_share"] <= lost + 1e-12).sum())
            of = f"{len(judged)} judged" if len(skipped) else f"{len(part)}"
            line = f"{fit} of {of} layers keep ≥ {keep * 100:.3g} % of their {what}."
        else:
            line = (
                f"No layer's {KINDS[kind]}s can be judged for {FORMATS[fmt].label}: every one "
                "held inf/NaN."
            )
        if len(skipped):
            # layers that held inf/NaN at the same steps are named together
            by_steps: dict[tuple[int, ...], list[str]] = {}
            for m, steps in zip(skipped["module"], skipped["nonfinite_steps"], strict=True):
                by_steps.setdefault(tuple(steps), []).append(str(m))
            named = [not_judged_text(_names(ms), steps) for steps, ms in by_steps.items()]
            left = f" Left out, {len(skipped)} of {len(part)}: " if len(judged) else " "
            line += left + "; ".join(named) + "."
        text.append(line)
    return text


@section("whatif", order=35, tab="Precision what-if")
def build_whatif_section(run: Run, diagnosis: Diagnosis) -> Section:
    """The precision what-if, or why it cannot be computed."""
    title = "Precision what-if (fp16 / bf16 / fp8)"
    whatif = compute_whatif(run)
    if whatif.empty:
        return Section(key="whatif", title=title, missing=MISSING)
    text = whatif_headline(whatif, keep_share(diagnosis))
    text.append(TOLERANCE)
    figures = tuple(make_run_exponent_heatmap(run, group, whatif) for group in heatmap_groups(run))
    # the block formats' layer x format matrix beside the heatmaps (or why it is not drawn)
    fit = run_block_fit(run, diagnosis)
    text += block_fit_text(run, fit)
    if not fit.empty:
        figures += (make_block_fit_figure(fit),)
    return Section(
        key="whatif",
        title=title,
        figures=figures,
        tables=(
            (
                "Per layer: share of nonzero values lost (overflow + flush to zero), cast as-is "
                "and with per-tensor scaling, summed over sampled steps",
                whatif_table(whatif),
            ),
        ),
        text=tuple(text),
    )
