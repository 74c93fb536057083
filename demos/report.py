"""An HTML page of a web-agent run that a person can open from the run folder.

One self-contained file: a summary table, then one section per step with its screenshot (a
relative ``<img>`` link into the run folder), the model's outputs, the action, what happened
and the cache figures. Every string that came from a model, a page or a user is escaped.

Not here: running anything or reading the run folder back (the caller passes the records).
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from typing import Any

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 24px; color: #1f2328; max-width: 1100px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin: 0 0 8px; }
table { border-collapse: collapse; } td, th { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; }
section { border: 1px solid #d0d7de; border-radius: 8px; padding: 12px; margin: 16px 0; }
section.failed { border-color: #d1242f; }
img { max-width: 100%; border: 1px solid #d0d7de; }
pre { background: #f6f8fa; padding: 8px; white-space: pre-wrap; word-break: break-word; margin: 4px 0; }
.ok { color: #1a7f37; } .bad { color: #d1242f; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _table(rows: Mapping[str, Any]) -> str:
    cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_fmt(v))}</td></tr>" for k, v in rows.items())
    return f"<table>{cells}</table>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, dict | list | tuple):
        return json.dumps(value)
    return str(value)


def _step(step: Mapping[str, Any]) -> str:
    ok = step.get("result_ok")
    status = "ok" if ok else (step.get("error") or "not executed")
    outputs = "".join(f"<pre>{_e(o)}</pre>" for o in step.get("outputs", [])) or "<p>(no model run)</p>"
    parse_errors = "".join(f"<li>{_e(p)}</li>" for p in step.get("parse_errors", []))
    shot = step.get("screenshot")
    image = f'<img src="{_e(shot)}" alt="screenshot of step {_e(step["step"])}">' if shot else ""
    figures = {k: step[k] for k in ("ttft_ms", "source", "cache") if k in step}
    return (
        f'<section class="{"" if ok else "failed"}" id="step-{_e(step["step"])}">'
        f"<h2>Step {_e(step['step'])}: <code>{_e(step.get('action') or '(none)')}</code></h2>"
        f"<p>URL before: <code>{_e(step.get('url', ''))}</code> &rarr; after: "
        f"<code>{_e(step.get('url_after', ''))}</code>; "
        f'<span class="{"ok" if ok else "bad"}">{_e(status)}</span></p>'
        f"{image}<h3>Model output</h3>{outputs}"
        + (f"<h3>Unparsed answers</h3><ul>{parse_errors}</ul>" if parse_errors else "")
        + f"<h3>Cache</h3>{_table(figures)}</section>"
    )


def render_run(title: str, summary: Mapping[str, Any], steps: Sequence[Mapping[str, Any]]) -> str:
    """The HTML of a run: ``summary`` as a table, ``steps`` as sections (see module doc)."""
    body = "".join(_step(s) for s in steps)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{_e(title)}</h1>{_table(summary)}{body}</body></html>\n"
    )
