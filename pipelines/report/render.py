"""Page model -> text: the Jinja2 templates under ``templates/`` rendered to HTML and Markdown.

One environment per format. HTML: autoescape on; every ``{{ value }}`` that is not already
markup is escaped with :func:`html.escape` (``quote=True``: ``& < > " '``), the escaping the
report has always used. Markdown: the ``md`` filter (:func:`md_escape`) on every data string and
``md_url`` on links. Templates are package data (``pipelines/report/templates/*``).
"""
from __future__ import annotations

import base64
import html
import re
from functools import lru_cache
from typing import Any

import jinja2
from markupsafe import Markup

from pipelines.report.page import AuditPage, ReportPage

__all__ = ["md_escape", "md_url", "render_html", "render_markdown", "render_audit_html", "render_audit_markdown"]

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def md_escape(s: Any) -> str:
    """Markdown-escape a data string: ``& < >`` as HTML entities (no raw HTML can get through),
    other Markdown punctuation with backslashes (also safe inside table cells); newlines -> spaces."""
    return _MD_SPECIAL.sub(r"\\\1", html.escape(str(s), quote=False)).replace("\n", " ")


def md_url(link: str) -> str:
    """A link target that ends where Markdown expects: spaces and ``)`` percent-encoded."""
    return str(link).replace(" ", "%20").replace(")", "%29")


def _html_finalize(value: Any) -> Any:
    return value if isinstance(value, Markup) else Markup(html.escape(str(value), quote=True))


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


@lru_cache(maxsize=None)
def _env(fmt: str) -> jinja2.Environment:
    html_fmt = fmt == "html"
    env = jinja2.Environment(loader=jinja2.PackageLoader("pipelines.report", "templates"),
                             autoescape=html_fmt, finalize=_html_finalize if html_fmt else None,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    env.filters.update(b64=_b64, md=md_escape, md_url=md_url)
    return env


def _render(template: str, page: Any) -> str:
    return _env(template.rsplit(".", 2)[-2]).get_template(template).render(page=page)


def render_html(page: ReportPage) -> str:
    """The self-contained report page (figures inlined as ``data:image/png;base64`` URIs)."""
    return _render("report.html.j2", page)


def render_markdown(page: ReportPage) -> str:
    """The report in Markdown (figures linked by their ``link``)."""
    return _render("report.md.j2", page)


def render_audit_html(page: AuditPage) -> str:
    return _render("audit.html.j2", page)


def render_audit_markdown(page: AuditPage) -> str:
    return _render("audit.md.j2", page)
