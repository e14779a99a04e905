"""Several sweeps side by side (arms, seeds): markdown tables, a figure and paired tests.

    from qedprobe.eval.report import build_report
    md = build_report(["runs/gdn2_seed0", "runs/qed_seed0"], labels=["GDN-2", "QED"], s=1.0,
                      out="runs/report")

Tables (Table 3 / Table 4 style):

1. accuracy (%) per length (rows) and sweep (columns) at strength ``s``, with the Wilson 95%
   interval and ``n``, then RULER's score (``string_match_all``, percent) in the same layout;
2. paired tests of every sweep against the baseline (the first, or ``baseline=``) on the samples
   both have, matched on ``(length, sample_id)`` *and* the prompt fingerprint ``prompt_sha`` (so
   only identical prompts pair): ``b`` = right in the sweep, wrong in the baseline; ``c`` the
   reverse; exact two-sided McNemar ``p``;
3. for each sweep with several strengths, accuracy per length x s with the McNemar ``p`` against
   its reference strength.

The figure ``report.png`` plots accuracy vs length, one line per sweep (at strength ``s``), and
accuracy vs strength at the longest length, one line per sweep.

A report row is a ``(task, length)``: a sweep has one task, so its rows are its lengths; an
lm-eval folder (``qedprobe.lmeval.run``) has several tasks, some without lengths, and its rows
name their task.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from .stats import mcnemar_exact
from .plots import (LOG_SPREAD, accuracy_errorbar, figure, format_length, label_accuracy_axis, mark_significant,
                    paired_note, save_figure, series_color, series_style)
from .store import SweepError, load_results, strength_key
from .summary import cell_order, length_key, summarize

__all__ = ["load_sweep", "build_report", "paired_between"]


def load_sweep(path, label=None) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise SweepError(f"{str(path)!r} is not a sweep folder")
    rows = load_results(path)
    cfg = {}
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
    if label is None:  # the model's folder name, else the sweep's (sweeps are often all called "sweep")
        model_id = (cfg.get("model") or {}).get("id")
        label = Path(model_id).name if model_id else path.name or str(path)
    return {"path": str(path), "label": label, "rows": rows, "config": cfg}


def _cells(rows, s):
    """(task, length, sample_id) -> (correct, prompt_sha) at strength s."""
    s = strength_key(s)
    return {(r.get("task", ""), length_key(r["length"]), int(r["sample_id"])): (bool(r["correct"]), r.get("prompt_sha"))
            for r in rows if strength_key(r["s"]) == s}


def row_label(key, named: bool) -> str:
    """The name of a report row ``key = (task, length)``: the length (``2K``), after the task when
    the sweeps hold several tasks (``named``: an lm-eval folder); a task without lengths by its name."""
    task, length = key
    size = None if length is None else format_length(length)
    return " ".join(x for x in (task if named or size is None else None, size) if x) or "-"


def _named(keys) -> bool:
    """Whether report rows ``(task, length, ...)`` span several tasks (rows then name their task)."""
    return len({k[0] for k in keys}) > 1


def paired_between(rows_a, rows_b, s_a=1.0, s_b=1.0) -> dict:
    """Per ``(task, length)``: McNemar between sweep A at ``s_a`` and B at ``s_b`` on identical prompts.

    Returns ``{(task, length): {"n_paired", "acc_a", "acc_b", "b", "c", "p", "unmatched"}}`` where
    ``b`` is right in A and wrong in B, ``c`` the reverse, ``unmatched`` the shared ids whose
    prompts differ.
    """
    A, B = _cells(rows_a, s_a), _cells(rows_b, s_b)
    out = {}
    for length in sorted({k[:2] for k in A} & {k[:2] for k in B}, key=cell_order):
        keys = [k for k in A if k[:2] == length and k in B]
        same = [k for k in keys if A[k][1] == B[k][1]]
        b = sum(1 for k in same if A[k][0] and not B[k][0])
        c = sum(1 for k in same if B[k][0] and not A[k][0])
        n = len(same)
        out[length] = {"n_paired": n, "unmatched": len(keys) - n,
                       "acc_a": (sum(A[k][0] for k in same) / n) if n else math.nan,
                       "acc_b": (sum(B[k][0] for k in same) / n) if n else math.nan,
                       "b": b, "c": c, "p": mcnemar_exact(b, c) if n else math.nan}
    return out


def _fmt_p(p):
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "-"
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"


def _pick_s(sweep, s):
    have = sorted({strength_key(r["s"]) for r in sweep["rows"]})
    if strength_key(s) in have:
        return strength_key(s)
    if len(have) == 1:
        return have[0]
    raise SweepError(f"sweep {sweep['label']!r} has no rows at s = {s:g} (it has {have}); pass --s")


FEW_SHARED = 0.5
"""Below this fraction of shared prompts (of the smaller sweep's, at the compared strengths) a
pair of sweeps is reported with a warning: their tests rest on a few prompts only."""


def load_sweeps(paths, labels=None) -> list[dict]:
    """:func:`load_sweep` of each of ``paths``, labelled by ``labels`` or, when two would share a
    label, by their paths."""
    paths = list(paths)
    if not paths:
        raise SweepError("report needs at least one sweep folder")
    if labels is not None and len(labels) != len(paths):
        raise SweepError(f"{len(labels)} labels for {len(paths)} sweeps")
    sweeps = [load_sweep(p, None if labels is None else labels[j]) for j, p in enumerate(paths)]
    if labels is None and len({sw["label"] for sw in sweeps}) < len(sweeps):  # two sweeps of one model
        for sw in sweeps:
            sw["label"] = sw["path"]
    return sweeps


def baseline_index(sweeps, baseline) -> int:
    """The index of ``baseline`` (an index or a label) among ``sweeps``."""
    if isinstance(baseline, str):
        names = [sw["label"] for sw in sweeps]
        if baseline not in names:
            raise SweepError(f"`baseline` {baseline!r} is none of {names}")
        baseline = names.index(baseline)
    if isinstance(baseline, bool) or not isinstance(baseline, int) or not 0 <= baseline < len(sweeps):
        raise SweepError(f"`baseline` {baseline!r} is out of range: give an index 0..{len(sweeps) - 1} "
                         f"or a label of {[sw['label'] for sw in sweeps]}")
    return baseline


def _header(sweeps, named: bool) -> str:
    return ("| task | " if named else "| length | ") + " | ".join(
        sw["label"] + ("" if sw["s"] == sweeps[0]["s"] else f" (s={sw['s']:g})") for sw in sweeps) + " |"


def accuracy_tables(sweeps, lengths, title=None) -> list[str]:
    """Markdown lines: the title, accuracy with its interval per ``(task, length)`` of ``lengths``
    and sweep, then RULER's score."""
    lines = [f"# {title}", ""] if title else []
    task = sorted({r.get("task", "") for sw in sweeps for r in sw["rows"]})
    lines += [f"Task: {', '.join(task)}. Accuracy % (Wilson 95% interval; n) at strength "
              + ", ".join(f"s = {sw['s']:g}" for sw in sweeps[:1])
              + ("" if len({sw['s'] for sw in sweeps}) == 1 else " (per-sweep s in the header)")
              + ".", ""]
    named = _named(lengths)
    head = _header(sweeps, named)
    lines += [head, "|---|" + "---|" * len(sweeps)]
    for L in lengths:
        cells = []
        for sw in sweeps:
            r = sw["summary"].get(L)
            cells.append("-" if r is None else
                         f"{100 * r['accuracy']:.1f} [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}]; {r['n']}")
        lines.append(f"| {row_label(L, named)} | " + " | ".join(cells) + " |")
    lines += ["", "RULER score % (`string_match_all`: the mean share of the answers found, as RULER "
              "reports) at the same strengths.", "", head, "|---|" + "---|" * len(sweeps)]
    for L in lengths:
        cells = ["-" if sw["summary"].get(L) is None else f"{sw['summary'][L]['score_pct']:.2f}" for sw in sweeps]
        lines.append(f"| {row_label(L, named)} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _shared_prompts_warning(sw, base, res) -> str | None:
    """The warning when ``sw`` and ``base`` share fewer than :data:`FEW_SHARED` of their prompts."""
    shared = sum(v["n_paired"] for v in res.values())
    smaller = min(len(_cells(sw["rows"], sw["s"])), len(_cells(base["rows"], base["s"])))
    if shared >= FEW_SHARED * smaller:
        return None
    return (f"{sw['label']} and {base['label']} share {shared} of {smaller} prompts (same task, length, "
            "sample id and prompt text): the paired tests rest on those only; were both run "
            "with the same task, seed and samples?")


def paired_table(sweeps, baseline, warn) -> tuple[list[str], dict]:
    """Markdown lines of the McNemar tests of every sweep against ``sweeps[baseline]`` on shared
    prompts, and the tests ``{label: {(task, length): result}}``; ``warn`` gets each few-shared warning."""
    base = sweeps[baseline]
    lines = [f"Paired exact McNemar tests against **{base['label']}** on identical prompts "
             "(b = right in the arm, wrong in the baseline; c = the reverse).", "",
             "| arm | length | n paired | baseline % | arm % | b | c | p |",
             "|---|---|---|---|---|---|---|---|"]
    tests, warned = {}, []
    for j, sw in enumerate(sweeps):
        if j == baseline:
            continue
        res = paired_between(sw["rows"], base["rows"], sw["s"], base["s"])
        tests[sw["label"]] = res
        message = _shared_prompts_warning(sw, base, res)
        if message is not None:
            warn(message)
            warned.append(message)
        if not res or all(v["n_paired"] == 0 for v in res.values()):
            lines.append(f"| {sw['label']} | - | 0 | - | - | - | - | no shared prompts |")
            continue
        for L, v in res.items():
            if not v["n_paired"]:
                continue
            lines.append(f"| {sw['label']} | {row_label(L, _named(res))} | {v['n_paired']} | {100 * v['acc_b']:.1f} | "
                         f"{100 * v['acc_a']:.1f} | {v['b']} | {v['c']} | {_fmt_p(v['p'])} |")
    lines.append("")
    lines += [f"Warning: {m}" for m in warned] + ([""] if warned else [])
    return lines, tests


def strength_table(sw) -> list[str]:
    """Markdown lines of one sweep's accuracy by strength (McNemar against its reference
    strength); none for a sweep of one strength."""
    strengths = sorted({strength_key(r["s"]) for r in sw["rows"]})
    if len(strengths) < 2:
        return []
    ref = sw["config"].get("ref_strength", 1.0)
    summ = summarize(sw["rows"], ref)
    cell = {(r["task"], r["length"], r["s"]): r for r in summ}
    named = _named(cell)
    lines = [f"**{sw['label']}**: accuracy % by strength s (McNemar p against s = {ref:g}; b/c).", "",
             ("| task | " if named else "| length | ") + " | ".join(f"s={x:g}" for x in strengths) + " |",
             "|---|" + "---|" * len(strengths)]
    for L in sorted({k[:2] for k in cell}, key=cell_order):
        cells = []
        for x in strengths:
            r = cell.get((*L, x))
            if r is None:
                cells.append("-")
            elif r["mcnemar_p"] is None or x == strength_key(ref):
                cells.append(f"{100 * r['accuracy']:.1f}")
            else:
                cells.append(f"{100 * r['accuracy']:.1f} (p={_fmt_p(r['mcnemar_p'])}; {r['b']}/{r['c']})")
        lines.append(f"| {row_label(L, named)} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _json_key(key, named: bool) -> str:
    """A report row's key in ``report.json``: its length (``"1024"``), ``task/length`` or ``task``
    when the sweeps hold several tasks."""
    task, length = key
    return str(length) if not named else task if length is None else f"{task}/{length}"


def write_report(out, md: str, sweeps, baseline: int, tests: dict, lengths, title=None) -> None:
    """``out/report.md``, ``out/report.json`` (summaries, baseline, paired tests) and ``out/report.png``
    (:func:`_plot`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(md + "\n")
    (out / "report.json").write_text(json.dumps({
        "sweeps": [{"path": sw["path"], "label": sw["label"], "s": sw["s"],
                    "summary": list(sw["summary"].values())} for sw in sweeps],
        "baseline": sweeps[baseline]["label"],
        "paired_tests": {k: {_json_key(L, _named(lengths)): v for L, v in res.items()} for k, res in tests.items()},
    }, indent=2, default=float) + "\n")
    _plot(sweeps, lengths, out / "report.png", title)


def build_report(paths, *, labels=None, s=1.0, baseline=0, out=None, title=None, warn=None) -> str:
    """Markdown report of the sweeps in ``paths``; with ``out``, also ``report.md``,
    ``report.json`` and ``report.png``.

    Steps: load and label the sweeps, pick each one's strength ``s`` and summarise it, then the
    accuracy tables, the paired tests against ``baseline`` (with two or more sweeps) and each
    sweep's strength table. ``warn(message)`` is called for each sweep that shares fewer than
    :data:`FEW_SHARED` of its prompts with the baseline (default: ``warnings.warn``); the report
    states it too."""
    warn = warn or (lambda message: warnings.warn(message, stacklevel=3))
    sweeps = load_sweeps(paths, labels)
    baseline = baseline_index(sweeps, baseline)
    for sw in sweeps:
        sw["s"] = _pick_s(sw, s)
        sw["summary"] = {(r["task"], r["length"]): r for r in summarize(sw["rows"], None) if r["s"] == sw["s"]}
    lengths = sorted({L for sw in sweeps for L in sw["summary"]}, key=cell_order)
    lines = accuracy_tables(sweeps, lengths, title)
    tests = {}
    if len(sweeps) > 1:
        paired, tests = paired_table(sweeps, baseline, warn)
        lines += paired
    for sw in sweeps:
        lines += strength_table(sw)
    md = "\n".join(lines)
    if out is not None:
        write_report(out, md, sweeps, baseline, tests, lengths, title)
    return md


def _plot(sweeps, keys, path, title):
    """``report.png``: accuracy vs length at each sweep's strength ``s`` (left) and accuracy vs
    strength at the longest length (right: the strength dimension, with the reference strength
    dotted and ``*`` where a strength differs from it, McNemar p < 0.05), one colour and marker per
    sweep (and task, when there are several), over the ``(task, length)`` keys that have a length;
    no figure when none has (lm-eval tasks without lengths)."""
    lines = [(sw, task) for sw in sweeps for task in sorted({t for t, L in keys if L is not None})]
    lengths = sorted({L for _, L in keys if L is not None})
    if not lengths:
        return
    fig = figure(figsize=(11, 4.6))
    by_length, by_strength = fig.subplots(1, 2)
    named = _named(keys)
    for j, (sw, task) in enumerate(lines):
        pts = [(L, sw["summary"][(task, L)]) for L in lengths if (task, L) in sw["summary"]]
        if pts:
            accuracy_errorbar(by_length, pts, log_x=True, **series_style(j, len(lines), LOG_SPREAD),
                              color=series_color(j), label=sw["label"] + (f", {task}" if named else ""))
    if title is None:
        tasks = sorted({r.get("task", "?") for sw in sweeps for r in sw["rows"]})
        title = f"{', '.join(tasks)}: accuracy by context length"
    label_accuracy_axis(by_length, xlabel="context length (tokens)", legend=False, lengths=lengths,
                        title=f"{title}\nat s = " + ", ".join(sorted({f"{sw['s']:g}" for sw in sweeps})))
    note = _strength_panel(by_strength, lines, max(lengths), named)
    fig.legend(*by_length.get_legend_handles_labels(), loc="upper right", fontsize=8)
    save_figure(fig, path, note, right=0.86)


def _strength_panel(ax, lines, length, named) -> str | None:
    """Accuracy vs strength at ``length``, one line per ``(sweep, task)`` of ``lines``, with
    every strength a sweep ran (summarised against its own reference strength); returns the
    paired tests' note (:func:`qedprobe.eval.plots.paired_note`)."""
    cells, strengths = [], set()
    for j, (sw, task) in enumerate(lines):
        ref = sw["config"].get("ref_strength", 1.0)
        rows = [r for r in summarize(sw["rows"], ref) if r["task"] == task and r["length"] == length and r["n"]]
        if rows:
            moved = accuracy_errorbar(ax, [(r["s"], r) for r in rows], **series_style(j, len(lines), 0.15),
                                      color=series_color(j))
            mark_significant(ax, moved, rows, series_color(j))
            cells += [{**r, "task": f"{sw['label']}" + (f", {task}" if named else "")} for r in rows]
            strengths |= {r["s"] for r in rows}
    refs = {r["ref_s"] for r in cells if r.get("ref_s") is not None}
    for ref in refs:
        ax.axvline(ref, color="grey", lw=1, ls=":")
    label_accuracy_axis(ax, xlabel="strength s (lambda x s)", legend=False, strengths=sorted(strengths),
                        title=f"the strength dimension at L = {format_length(length)}"
                              + (f" (dotted: reference s = {', '.join(f'{r:g}' for r in sorted(refs))})" if refs else ""))
    return paired_note(cells, named=True)
