"""report.html: one self-contained page (plots inline, playbook sections embedded, no network)."""
from __future__ import annotations

import base64
import re

import jinja2
from markupsafe import Markup
from markdown_it import MarkdownIt

from harness.lib.playbook import Section
from harness.report.build import next_step, steps_to_take
from harness.report.markdown import PLAYBOOKS_DIR, SEVERITY_ORDER, when
from harness.report.model import FindingGroup, Report

_MD = MarkdownIt("commonmark", {"html": False}).enable("table").disable("image")  # no remote images: offline page
_PLAYBOOK_LINK = re.compile(r'href="(?!https?:|#|/)([\w.-]+\.md)(#[\w-]*)?"')


def anchor_of(section: Section) -> str:
    """The element id of an embedded playbook section."""
    return f"pb-{section.family}" + (f"-{section.anchor}" if section.anchor else "")


def markdown_html(text: str) -> str:
    return _MD.render(text)


def _playbook_html(section: Section) -> str:
    """A playbook section as HTML; its links to other playbooks point at the copies beside the report."""
    rendered = markdown_html(section.text)
    return _PLAYBOOK_LINK.sub(lambda m: f'href="{PLAYBOOKS_DIR}/{m.group(1)}{m.group(2) or ""}"', rendered)


_TEMPLATE = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string("""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{ report.title }}</title>
<style>
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;width:100%;font-size:.9em;margin:.5em 0}th,td{border:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#f5f5f5}code{background:#f3f3f3;padding:0 3px;border-radius:3px}
.verdict{padding:.8em 1em;border-radius:6px;font-size:1.1em;margin:1em 0}
.verdict.healthy{background:#e6f4ea;border:1px solid #34a853}.verdict.needs-attention{background:#fef7e0;border:1px solid #f9ab00}
.verdict.failed{background:#fce8e6;border:1px solid #d93025}
.sev{font-weight:bold;text-transform:uppercase;font-size:.8em}.sev-critical,.sev-error{color:#d93025}.sev-warning{color:#b06000}.sev-info{color:#555}
img.plot{max-width:100%;border:1px solid #eee;margin:.4em 0}.playbook{border-left:3px solid #ccc;padding-left:1em;margin:1em 0}
.muted{color:#666;font-size:.85em}
</style></head><body>
<h1>{{ report.title }}</h1>
<div id="verdict" class="verdict {{ verdict_class }}"><strong>Verdict: {{ report.verdict.label }}.</strong> {{ report.verdict.reason }}</div>
<h2 id="findings">Findings</h2>
{% if not report.groups %}<p>{{ report.no_findings_text }}</p>{% endif %}
{% for severity, groups in by_severity %}
<h3><span class="sev sev-{{ severity.value }}">{{ severity.value }}</span> ({{ groups | sum(attribute='count') }})</h3>
<table class="findings"><thead><tr><th>code</th><th>count</th><th>steps</th><th>ranks</th><th>what happened</th><th>action</th><th>evidence</th></tr></thead><tbody>
{% for g in groups %}<tr class="finding" data-code="{{ g.code }}">
<td>{% if g.playbook %}<a href="#{{ anchor_of(g.playbook) }}">{{ g.code }}</a>{% else %}{{ g.code }}{% endif %}</td>
<td>{{ g.count }}</td><td>{{ g.step_range }}</td><td>{{ g.ranks | join(',') }}</td><td>{{ g.message | truncate(600) }}</td>
<td>{{ g.actions | join(', ') or '-' }}</td>
<td>{% for label, path in g.evidence %}<a href="{{ path }}">{{ label }}</a>{% if not loop.last %}, {% endif %}{% else %}-{% endfor %}</td></tr>
{% endfor %}</tbody></table>
{% endfor %}
{% if next_steps %}<h2 id="next-steps">Next steps</h2><ol>
{% for g in next_steps %}<li><strong>{{ g.code }}</strong> (step {{ g.step_range }}): {{ md_inline(next_step(g, report.run_dir.parent)) }}{% if g.playbook %} (<a href="#{{ anchor_of(g.playbook) }}">playbook</a>){% endif %}</li>
{% endfor %}</ol>{% endif %}
{% if report.symptoms %}<h2 id="worth-a-look">Worth a look</h2><ul>
{% for symptom, section in report.symptoms %}<li>{% if section %}<a href="#{{ anchor_of(section) }}">{{ section.title }}</a>{% else %}{{ symptom.topic }}{% endif %}: {{ symptom.why }}</li>
{% endfor %}</ul>{% endif %}
{% if report.plots %}<h2 id="plots">Plots</h2>
{% for plot in report.plots %}<figure><img class="plot" id="plot-{{ plot.name }}" alt="{{ plot.title }}" src="data:image/png;base64,{{ b64(plot.png) }}"></figure>
{% endfor %}{% endif %}
<h2 id="run-card">Run card</h2>
<table class="card"><tbody>{% for label, value in report.card %}<tr><th>{{ label }}</th><td>{{ value }}</td></tr>{% endfor %}</tbody></table>
{% if report.attempts %}<h2 id="attempts">Attempts</h2>
<table><thead><tr><th>#</th><th>started</th><th>resumed from</th><th>steps</th><th>ended</th><th>error</th></tr></thead><tbody>
{% for a in report.attempts %}<tr><td>{{ loop.index }}</td><td>{{ when(a.get('started')) }}</td><td>{{ a.get('resumed_from') or '-' }}</td>
<td>{{ a.get('start_step', '?') }}-{{ a.get('end_step', '?') }}</td><td>{{ a.get('outcome') or a.get('status') }}</td><td>{{ a.get('error', '-') | string | truncate(300) }}</td></tr>
{% endfor %}</tbody></table>{% endif %}
{% for section in report.sections %}<h2>{{ section.title }}</h2>
<div class="plugin-section" data-plugin="{{ section.plugin }}">{{ md(section.markdown) }}
{% for plot in section.plots %}<figure><img class="plot" id="plot-{{ plot.name }}" alt="{{ plot.title }}" src="data:image/png;base64,{{ b64(plot.png) }}"><figcaption class="muted"><a href="report/plots/{{ plot.name }}.png">{{ plot.title }}</a></figcaption></figure>
{% endfor %}</div>
{% endfor %}
{% if report.notes %}<h2>Notes</h2><ul>{% for note in report.notes %}<li>{{ note }}</li>{% endfor %}</ul>{% endif %}
{% if report.playbook_sections %}<h2 id="playbooks">Playbooks</h2>
{% for section in report.playbook_sections %}<section class="playbook" id="{{ anchor_of(section) }}">{{ playbook(section) }}</section>
{% endfor %}{% endif %}
<p class="muted">Built from {{ report.run_dir }} at {{ built }}; rebuild with <code>harness report {{ report.run_dir.parent }}</code>.</p>
</body></html>
""")


def render_html(report: Report) -> str:
    import datetime as dt

    by_severity = [(s, [g for g in report.groups if g.severity is s]) for s in SEVERITY_ORDER]
    return _TEMPLATE.render(
        report=report,
        verdict_class=report.verdict.label.replace(" ", "-"),
        by_severity=[(s, gs) for s, gs in by_severity if gs],
        next_steps=steps_to_take(report.groups),
        anchor_of=anchor_of,
        next_step=next_step,
        b64=lambda data: base64.b64encode(data).decode("ascii"),
        md=lambda text: Markup(markdown_html(text)),
        md_inline=lambda text: Markup(_MD.renderInline(text)),
        playbook=lambda section: Markup(_playbook_html(section)),
        when=when,
        built=dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
    )


__all__ = ["FindingGroup", "anchor_of", "render_html"]
