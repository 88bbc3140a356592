"""The live dashboard's files: ``GET /`` and the page's script, styles and charting library.

The page (``api/dashboard/``: HTML, CSS, our script and uPlot 1.6.32, vendored with its MIT licence)
holds no data of the node: it reads the JSON routes every 2 s, and those need the API token exactly as
for any client (``app.ApiApp``). So the files themselves are served without the token, to a browser
that cannot send a header on navigation; the page takes the token from its URL's fragment
(``/#token=...``, never sent to a server) and sends it with each request. Read once, kept in memory.
"""

from __future__ import annotations

import functools
from importlib import resources

from p2pswarm.api.http import TextReply

ASSETS = {  # path -> (file in api/dashboard/, content type)
    "/": ("index.html", b"text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", b"text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", b"text/css; charset=utf-8"),
    "/uPlot.min.js": ("uPlot.iife.min.js", b"text/javascript; charset=utf-8"),
    "/uPlot.min.css": ("uPlot.min.css", b"text/css; charset=utf-8"),
}
HEADERS = [  # no script, style or connection from anywhere but this node; never framed by another site
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-cache"),
]


@functools.cache
def asset(path: str) -> TextReply | None:
    """The dashboard file served at ``path``, or None when ``path`` is not one."""
    found = ASSETS.get(path)
    if found is None:
        return None
    name, content_type = found
    body = resources.files("p2pswarm.api").joinpath("dashboard", name).read_bytes()
    return TextReply(body, content_type, tuple(HEADERS))
