"""``report.html``: one self-contained page (no scripts, no network) with inline SVG charts of
the memory of every candidate and the throughput of every trial.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from autoshard.config import Candidate, Hardware
from autoshard.errors import AutoshardError
from autoshard.measure import spread_of
from autoshard.results import Decision, MemoryEstimate, TrialResult
from autoshard.ui.charts import Page, page_of, throughput_chart
from autoshard.ui.charts_memory import memory_chart
from autoshard.ui.charts_speed import speed_chart
from autoshard.ui.report import (
    MEASURED,
    error_text,
    group_line,
    never_launched,
    never_launched_groups,
    outcome,
    predicted_per_rank,
    prediction_error,
    rate_per_rank,
    settings_of,
    trials_note,
    why_ruled_out,
)
from autoshard.ui.timeline import timeline_chart
from autoshard.units import format_bytes, format_share


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _table(page: Page) -> str:
    """Every candidate that ran (or, for an estimate, was listed) one row each; those never
    launched one row per reason they share, with their labels folded under it."""
    device = page.device
    listed = [(k, s) for k, s in page.rows if never_launched(s) is None]
    errors = [prediction_error(s, page.hardware) for _, s in listed]
    # The model's error exists only where trials ran on the device predicted for.
    with_error = any(e is not None for e in errors)
    head = ["", "configuration", "predicted peak / rank", "measured peak / rank",
            f"predicted throughput / GPU ({device})", "measured throughput / GPU (one rank)",
            *(["model error"] if with_error else []), "s/step", "outcome"]  # fmt: skip
    rows = ["<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>"]
    for (kind, s), error in zip(listed, errors, strict=True):
        t, e = s.trial, s.estimate
        predicted, p_unit = predicted_per_rank(s, page.hardware)
        measured, m_unit = rate_per_rank(t)
        result = outcome(s)
        if result == MEASURED or (kind in ("chosen", "runner-up") and result is None):
            status = MEASURED if result else "fits, not tried"
        else:
            status = why_ruled_out(s)
        cells = [
            kind,
            s.candidate.label(),
            format_bytes(e.gpu_peak) if e else "",
            format_bytes(t.max_allocated) if t and t.max_allocated else "",
            f"{predicted:,.0f} {p_unit}" if predicted else "",
            f"{measured:,.0f} {m_unit} ±{spread_of(t):.0%}" if measured and t else "",
            *([error_text(s, error, page.rows) if error is not None else ""] if with_error else []),
            f"{t.step_time:.3f}" if t and t.step_time else "",
            status,
        ]
        cls = ' class="chosen"' if kind == "chosen" else ""
        rows.append(
            f'<tr{cls} data-outcome="{_esc(result or "not tried")}">'
            + "".join(f"<td>{_esc(c)}</td>" for c in cells)
            + "</tr>"
        )
    rows += _grouped_rows(page, len(head))
    return '<table id="configurations">' + "\n".join(rows) + "</table>"


def _grouped_rows(page: Page, columns: int) -> list[str]:
    """A row per reason shared by candidates never launched: the outcome, how many, the reason
    once, and the candidates' labels folded (a 5-line reason is not written 32 times)."""
    out = []
    for word, n, why, labels in never_launched_groups(page.rows):
        folded = "".join(f"<li>{_esc(label)}</li>" for label in labels)
        out.append(
            f'<tr class="group" data-outcome="{_esc(word)}" data-count="{n}">'
            f'<td>{_esc(word)}</td><td colspan="{columns - 2}"><details><summary>'
            f"{n} candidate{'s' if n != 1 else ''}</summary><ul>{folded}</ul></details></td>"
            f"<td>{_esc(group_line(word, n, why))}</td></tr>"
        )
    return out


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;
 max-width:1100px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:4px 8px;
 text-align:left} tr.chosen td{background:#e8f5e9;font-weight:600}
svg{font-size:12px;font-family:inherit;display:block;margin:8px 0;max-width:100%;height:auto}
 svg .t{font-weight:600}
svg .s{font-size:11px} svg .dim{fill:#666} ul{margin:4px 0}
 p.note{background:#fff8e1;border-left:4px solid #f9a825;padding:6px 10px}
 pre{background:#f6f8fa;padding:10px;font-size:12px;overflow:auto} .dim{color:#666}
"""


def _timeline_section(rec: Decision) -> str:
    """The chosen configuration's memory over its step, where the decision carries it."""
    chart = timeline_chart(rec)
    if not chart:
        return ""
    seconds = "calibrated" if rec.timeline and rec.timeline.calibrated else "uncalibrated"
    return (
        "<h2>Memory over the chosen configuration's step</h2>\n"
        f'<p class="dim">Memory events of the analytic estimate on the {seconds} speed '
        "model's seconds (<code>autoshard estimate --timeline</code> lists them)</p>\n" + chart
    )


def render_html(rec: Decision, trials: Sequence[TrialResult] = ()) -> str:
    """One self-contained HTML page: no scripts, no network, charts as inline SVG."""
    from autoshard.emit.prose import choose_state_dict_type
    from autoshard.emit.text import lightning_cli_yaml

    page = page_of(rec, trials)
    note = trials_note(rec, page.trials)
    settings = "".join(
        f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in settings_of(rec).items()
    )
    reasons = "".join(f"<li>{_esc(r)}</li>" for r in (*rec.reasons, choose_state_dict_type(rec)[1]))
    try:
        yaml_text = lightning_cli_yaml(rec)
    except AutoshardError as exc:
        yaml_text = f"# {exc}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autoshard: {_esc(rec.profile.target)}</title>
<style>{_CSS}</style></head><body>
<h1>autoshard recommendation: {_esc(rec.chosen.candidate.label())}</h1>
<p class="dim">{_esc(rec.profile.target)} · {rec.profile.total_params:,} parameters ·
{rec.hardware.nodes} x {rec.hardware.gpus_per_node} GPUs of
{_esc(format_bytes(rec.hardware.gpu_memory))} · chosen by {_esc(rec.basis)} ·
{_esc(rec.created_at.strftime("%Y-%m-%d %H:%M UTC"))}</p>
<h2>Chosen configuration</h2><table id="chosen">{settings}</table>
<h2>Why it won</h2><ul>{reasons}</ul>
<h2>Memory per candidate</h2>
{memory_chart(page)}
{_timeline_section(rec)}
<h2>Predicted and measured throughput</h2>
{f'<p class="note">{_esc(note)}</p>' if note else ""}
{speed_chart(page)}
<h2>Throughput and memory of every trial</h2>
{throughput_chart(page)}
<h2>All configurations</h2>
{_table(page)}
<h2>Lightning CLI</h2><pre>{_esc(yaml_text)}</pre>
</body></html>
"""


def render_failed_html(target: str, params: int, page: Page, error: str, created: str) -> str:
    """The page of a study in which no configuration ran: what failed and why (the one line the
    command printed), every trial and what kept each candidate out, the memory predicted."""
    hw = page.hardware
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autoshard: {_esc(target)}</title>
<style>{_CSS}</style></head><body>
<h1>autoshard: no configuration ran</h1>
<p class="dim">{_esc(target)} · {params:,} parameters · {hw.nodes} x {hw.gpus_per_node} GPUs of
{_esc(format_bytes(hw.gpu_memory))} · {_esc(created)}</p>
<p class="note" id="failure">{_esc(error)}</p>
<h2>All configurations</h2>
{_table(page)}
<h2>Memory per candidate</h2>
{memory_chart(page)}
<h2>Throughput and memory of every trial</h2>
{throughput_chart(page)}
</body></html>
"""


def recommendation_html(rec: Decision) -> str:
    """A notebook cell's view of a recommendation: the choice, its settings, why."""
    settings = "".join(
        f"<tr><th style='text-align:left'>{_esc(k)}</th><td style='text-align:left'>{_esc(v)}"
        "</td></tr>"
        for k, v in settings_of(rec).items()
    )
    reasons = "".join(f"<li>{_esc(r)}</li>" for r in rec.reasons[:12])
    return (
        f"<div><b>autoshard recommends {_esc(rec.chosen.candidate.label())}</b> "
        f"<span>(by {_esc(rec.basis)})</span><table>{settings}</table>"
        f"<details><summary>why</summary><ul>{reasons}</ul></details></div>"
    )


def estimates_html(
    estimates: Sequence[MemoryEstimate],
    hardware: Hardware | None,
    chosen: Candidate | None = None,
    limit: int | None = 20,
) -> str:
    """A notebook cell's view of a list of estimates: one row per candidate (the first
    ``limit``), the recommended one (``chosen``) marked."""
    head = ("configuration", "fits", "GPU peak", "headroom", "host / node", "tokens/s per GPU",
            "MFU")  # fmt: skip
    rows = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    shown = list(estimates) if limit is None else list(estimates)[:limit]
    for e in shown:
        s = e.speed
        mark = chosen is not None and e.candidate == chosen
        cells = (
            e.candidate.label() + (" ← recommended" if mark else ""),
            "yes" if e.fits else "no",
            format_bytes(e.gpu_peak),
            format_bytes(e.headroom),
            format_bytes(e.host_peak) if e.host_peak else "",
            f"{s.tokens_per_s_per_gpu:,.0f}" if s and s.tokens_per_s_per_gpu else "",
            format_share(s.mfu) if s and s.mfu is not None else "",
        )
        style = ' class="recommended" style="font-weight:bold;background:#e8f5e9"' if mark else ""
        rows.append(f"<tr{style}>" + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>")
    title = ""
    if hardware is not None:
        title = (
            f"<p>{hardware.nodes} x {hardware.gpus_per_node} GPUs of "
            f"{_esc(format_bytes(hardware.gpu_memory))}; fitting candidates first</p>"
        )
    more = len(estimates) - len(shown)
    tail = f"<p>{more} more not shown (list(estimates) has them all)</p>" if more > 0 else ""
    return f"<div>{title}<table>{''.join(rows)}</table>{tail}</div>"
