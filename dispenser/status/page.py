"""The status page in HTML: server-rendered tables, every value escaped, inline CSS, a few lines of script.

The page works offline and loads nothing: no framework, no font, no image. Its script re-fetches the page
every second and swaps in the new ``<main>``, so the one renderer that escapes is this module's (a second
renderer in JavaScript would have to escape again); ``/status.json`` is the same snapshot for tools. The
page's Content-Security-Policy allows its own style and script only (by hash), and fetches to its origin.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import html
from collections.abc import Iterable, Sequence

from dispenser.status.errors import LoggedError
from dispenser.status.snapshot import PeerStatus, SegmentRun, SegmentTag, SnowflakeStatus, WorkerStatus

__all__ = ["CONTENT_SECURITY_POLICY", "render_page"]

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1b1b;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse;background:#fff;margin-bottom:.5em}
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top}
th{background:#eee;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
code{font:13px ui-monospace,monospace}.why{color:#555;font-size:.9em;max-width:28em}
.ok{color:#176f2c;font-weight:600}.bad{color:#a31515;font-weight:600}.none{color:#888}
dl{display:grid;grid-template-columns:max-content auto;gap:.15em 1em;background:#fff;padding:.5em;
border:1px solid #ccc;width:max-content}dt{font-weight:600}dd{margin:0}
#refresh{color:#555;font-size:.9em}#refresh.stale{color:#a31515}
"""

_SCRIPT = """
(function () {
  "use strict";
  var note = document.getElementById("refresh");
  async function refresh() {
    try {
      var answer = await fetch(location.pathname, {cache: "no-store", headers: {Accept: "text/html"}});
      if (!answer.ok) throw new Error("HTTP " + answer.status);
      var page = new DOMParser().parseFromString(await answer.text(), "text/html");
      var fresh = page.getElementById("status");
      if (!fresh) throw new Error("no status in the answer");
      document.getElementById("status").replaceWith(document.adoptNode(fresh));
      note.textContent = "live: refreshed every second";
      note.className = "";
    } catch (error) {
      note.textContent = "not refreshed (" + error.message + "): trying again every second";
      note.className = "stale";
    }
    setTimeout(refresh, 1000);
  }
  setTimeout(refresh, 1000);
})();
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; style-src {_sha256(_STYLE)}; script-src {_sha256(_SCRIPT)}; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The page's own style and script (by hash), fetches to its own origin, nothing else: an escaping slip
could not run a script or load anything."""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _int(value: int | None) -> str:
    return "&ndash;" if value is None else f"{value:,}"


def _rate(value: float | None) -> str:
    return "&ndash;" if value is None else f"{value:,.1f}"


def _moment(ms: int | None) -> str:
    if ms is None:
        return "&ndash;"
    moment = datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)
    return f"{moment:%Y-%m-%d %H:%M:%S}.{ms % 1000:03d} UTC"


def _data(value: object) -> str:
    """A ``data-value`` attribute: the exact value (a boolean as in JSON), escaped; none for ``None``."""
    if value is None:
        return ""
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return f' data-value="{_e(text)}"'


def _cell(field: str, shown: str, value: object = None, css: str = "") -> str:
    """A cell, its ``data-field``, and its exact value in ``data-value`` (what a test or a script reads)."""
    attributes = f' data-field="{_e(field)}"{_data(value)}'
    if css:
        attributes += f' class="{css}"'
    return f"<td{attributes}>{shown}</td>"


def _table(headers: Sequence[str], rows: Iterable[str], empty: str) -> str:
    body = "".join(rows)
    if not body:
        return f'<p class="none">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _run(run: SegmentRun | None) -> str:
    if run is None:
        return '<span class="none">none</span>'
    return (
        f"<code>{run.first:,}&ndash;{run.last:,}</code><br>next <code>{run.next:,}</code>, {run.left:,} left"
    )


def _peers(peers: Sequence[PeerStatus]) -> str:
    if not peers:
        return '<span class="none">none heard</span>'
    lines = []
    for peer in peers:
        where = f" ({_e(peer.datacenter)})" if peer.datacenter else ""
        step = f", step {peer.step:,}" if peer.step else ""
        runway = f", runway {peer.runway_s:,.0f} s" if peer.runway_s is not None else ""
        lines.append(
            f"<code>{_e(peer.worker)}</code>{where}: {_rate(peer.ids_per_s)} IDs/s{step}{runway}, "
            f"{peer.age_s:g} s ago"
        )
    return "<br>".join(lines)


def _segment_row(tag: SegmentTag) -> str:
    runway = "∞ (no demand)" if tag.runway_s is None else f"{tag.runway_s:,.1f} s"
    why = f'<b>{_e(tag.why)}</b><div class="why">{_e(tag.why_detail)}</div>'
    queued = "<br>".join(_run(run) for run in tag.queued) or _run(None)
    fetching = " (fetching)" if tag.fetching else ""
    error = _e(tag.last_error) if tag.last_error else '<span class="none">none</span>'
    cells = [
        _cell("tag", f"<code>{_e(tag.tag)}</code>", tag.tag),
        _cell("step", _int(tag.step), tag.step, "n"),
        _cell("configured_step", _int(tag.configured_step), tag.configured_step, "n"),
        _cell("next_step", _int(tag.next_step), tag.next_step, "n"),
        _cell("why", why, tag.why),
        _cell("ids_buffered", _int(tag.ids_buffered), tag.ids_buffered, "n"),
        _cell("current", _run(tag.current), tag.current.next if tag.current else None),
        _cell("queued", queued + fetching, len(tag.queued)),
        _cell("runway_s", runway, tag.runway_s, "n"),
        _cell("ids_per_s", _rate(tag.ids_per_s), tag.ids_per_s, "n"),
        _cell("peak_ids_per_s", _rate(tag.peak_ids_per_s), tag.peak_ids_per_s, "n"),
        _cell("ids_total", _int(tag.ids_total), tag.ids_total, "n"),
        _cell("fetches_per_min", _rate(tag.fetches_per_min), tag.fetches_per_min, "n"),
        _cell("fetch_errors", _int(tag.fetch_errors), tag.fetch_errors, "n"),
        _cell("peers", _peers(tag.peers), len(tag.peers)),
        _cell("last_error", error, tag.last_error, "bad" if tag.last_error else ""),
    ]
    return f'<tr data-kind="segment" data-tag="{_e(tag.tag)}">{"".join(cells)}</tr>'


_SEGMENT_HEADERS = (
    "tag",
    "step",
    "configured",
    "next step",
    "why",
    "buffered",
    "current segment",
    "next segment",
    "runway",
    "IDs/s",
    "peak/s",
    "IDs handed out",
    "fetches/min",
    "fetch errors",
    "peers",
    "last error",
)


def _snowflake(snowflake: SnowflakeStatus | None) -> str:
    if snowflake is None:
        return '<p class="none">off on this worker</p>'
    lease = '<span class="ok">held</span>' if snowflake.holds_lease else '<span class="bad">not held</span>'
    if snowflake.clock_offset_ms is None:
        offset = "not measured (no live peer answered, or NATS is off)"
    else:
        offset = f"{snowflake.clock_offset_ms:+,.1f} ms (the mean of {snowflake.clock_peers} peer(s)' clocks)"
    items = [
        ("worker_id", "worker ID", _int(snowflake.worker_id), snowflake.worker_id),
        ("datacenter_id", "datacenter ID", _int(snowflake.datacenter_id), snowflake.datacenter_id),
        ("mode", "registry", _e(snowflake.mode), snowflake.mode),
        ("holds_lease", "lease", lease, snowflake.holds_lease),
        ("clock_offset_ms", "clock offset", _e(offset), snowflake.clock_offset_ms),
        (
            "clock_checked_ms",
            "clock checked",
            _moment(snowflake.clock_checked_ms),
            snowflake.clock_checked_ms,
        ),
        ("reserved_ms", "reserved up to", _moment(snowflake.reserved_ms), snowflake.reserved_ms),
        ("layout", "layout", _e(snowflake.layout), snowflake.layout),
        ("clock_waits", "clock waits", _int(snowflake.clock_waits), snowflake.clock_waits),
        (
            "clock_back_waits",
            "rollbacks waited out",
            _int(snowflake.clock_back_waits),
            snowflake.clock_back_waits,
        ),
        (
            "rollbacks_refused",
            "rollbacks refused",
            _int(snowflake.rollbacks_refused),
            snowflake.rollbacks_refused,
        ),
        ("refusal", "refusal", _e(snowflake.refusal or "none"), snowflake.refusal),
    ]
    terms = "".join(
        f'<dt>{label}</dt><dd data-field="{field}"{_data(value)}>{shown}</dd>'
        for field, label, shown, value in items
    )
    rows = (
        f'<tr data-kind="snowflake" data-tag="{_e(tag.tag)}">'
        + _cell("tag", f"<code>{_e(tag.tag)}</code>", tag.tag)
        + _cell("ids_per_s", _rate(tag.ids_per_s), tag.ids_per_s, "n")
        + _cell("peak_ids_per_s", _rate(tag.peak_ids_per_s), tag.peak_ids_per_s, "n")
        + _cell("ids_total", _int(tag.ids_total), tag.ids_total, "n")
        + _cell("peers", _peers(tag.peers), len(tag.peers))
        + "</tr>"
        for tag in snowflake.tags
    )
    table = _table(("tag", "IDs/s", "peak/s", "IDs handed out", "peers"), rows, "no tag served yet")
    return f"<dl>{terms}</dl>{table}"


def _logged(lines: Sequence[LoggedError]) -> str:
    rows = (
        "<tr>"
        + _cell("at", _moment(line.at_ms), line.at_ms)
        + _cell("level", _e(line.level), line.level, "bad" if line.level in ("ERROR", "CRITICAL") else "")
        + _cell("logger", f"<code>{_e(line.logger)}</code>", line.logger)
        + _cell("message", _e(line.message))
        + "</tr>"
        for line in lines
    )
    return _table(("time", "level", "logger", "message"), rows, "no warnings or errors logged")


def _readiness(status: WorkerStatus) -> str:
    if status.not_ready:
        reasons = "; ".join(status.not_ready)
        return f'<span class="bad" id="ready" data-value="false">not ready</span>: {_e(reasons)}'
    shown = '<span class="ok" id="ready" data-value="true">ready</span>'
    if status.cannot_issue:
        shown += f'; <span class="bad">cannot issue</span>: {_e("; ".join(status.cannot_issue))}'
    return shown


def _main(status: WorkerStatus) -> str:
    where = f" · datacenter <code>{_e(status.datacenter)}</code>" if status.datacenter else ""
    counts = (
        "<tr>"
        + _cell("kind", _e(error.kind), error.kind)
        + _cell("code", f"<code>{_e(error.code)}</code>", error.code)
        + _cell("count", _int(error.count), error.count, "n")
        + "</tr>"
        for error in status.errors
    )
    segments = _table(
        _SEGMENT_HEADERS, map(_segment_row, status.segments), "no segment tag (or segments are off)"
    )
    return (
        f'<main id="status" data-at="{status.at_ms}">'
        f"<h1>Leaf dispenser</h1><p>worker <code>{_e(status.worker)}</code>{where} · version "
        f'{_e(status.version)} · <span id="at">{_moment(status.at_ms)}</span> · {_readiness(status)}</p>'
        f'<section id="segments"><h2>Segment tags</h2>{segments}</section>'
        f'<section id="snowflake"><h2>Snowflake</h2>{_snowflake(status.snowflake)}</section>'
        '<section id="errors"><h2>Error replies since the start</h2>'
        f"{_table(('kind', 'code', 'count'), counts, 'none')}"
        f"<h2>Last warnings and errors logged</h2>{_logged(status.recent_errors)}</section>"
        "</main>"
    )


def render_page(status: WorkerStatus) -> str:
    """The whole page for ``status`` (every value from the snapshot escaped)."""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>dispenser · {_e(status.worker)}</title><style>{_STYLE}</style></head><body>"
        f'{_main(status)}<p id="refresh">live: refreshed every second</p>'
        f"<script>{_SCRIPT}</script></body></html>"
    )
