"""Who may read the dashboard: a bearer token, or a session cookie from a form.

Scrapers and scripts send ``Authorization: Bearer <token>``. A browser cannot
put a header on the page it navigates to, so the page used to take
``?token=`` in its URL; a URL is kept in browser history and in the access
logs of every proxy in between, so the token would leak there. Instead an
unauthorised page answers with a small form that POSTs the token to
``/login``; a right token gets a cookie (HttpOnly, SameSite=Strict, Secure
over https) whose value is an HMAC of the token, not the token, and the page
and its ``fetch`` calls carry that cookie. The token is never accepted in a
query string.
"""

from __future__ import annotations

import hashlib
import hmac
from html import escape
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

__all__ = ["SESSION_COOKIE", "is_authorised", "login", "login_form"]

SESSION_COOKIE = "shardcache_session"
SESSION_MAX_AGE_S = 12 * 3600  # a working day; then the form again
_SESSION_CONTEXT = b"shardcache-dashboard-session"  # keeps the cookie != the token
MAX_FORM_BYTES = 4096  # a token form; anything longer is not one


def _session_value(token: str) -> str:
    return hmac.new(token.encode(), _SESSION_CONTEXT, hashlib.sha256).hexdigest()


def is_authorised(request: Request, token: str | None) -> bool:
    """Whether the request carries the bearer token or the session cookie.

    >>> from starlette.requests import Request
    >>> scope = {"type": "http", "query_string": b"token=s3cret",
    ...          "headers": [(b"authorization", b"Bearer s3cret")]}
    >>> is_authorised(Request(scope), "s3cret"), is_authorised(Request(scope), "other")
    (True, False)
    """
    if not token:
        return True
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if given and hmac.compare_digest(given.encode(), token.encode()):
        return True
    cookie = request.cookies.get(SESSION_COOKIE, "")
    return bool(cookie) and hmac.compare_digest(
        cookie.encode(), _session_value(token).encode()
    )


def login_form(request: Request, *, wrong: bool = False) -> Response:
    """The 401 a browser gets: a form for the token, never a query string."""
    if wrong:
        note = "Wrong token: it is not the one this dashboard was started with."
    elif "token" in request.query_params:
        # An old bookmark: say why the URL no longer works, without echoing it.
        note = (
            "The token is no longer read from the URL, where browser history "
            "and proxy logs keep it; enter it here."
        )
    else:
        note = "This dashboard needs its token (SHARDCACHE_DASHBOARD_TOKEN)."
    body = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        "<title>shardcache dashboard: sign in</title></head><body>"
        f"<p id='note'>{escape(note)}</p>"
        "<form method='post' action='login'>"
        "<label>token <input type='password' name='token' autocomplete='off' "
        "autofocus></label> <button type='submit'>open</button></form>"
        "</body></html>"
    )
    return HTMLResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


async def login(request: Request, token: str | None) -> Response:
    """``POST /login``: a right token sets the session cookie and goes to the page."""
    if not token:
        return RedirectResponse("./", status_code=303)
    raw = await request.body()
    fields = parse_qs(raw[:MAX_FORM_BYTES].decode("utf-8", "replace"))
    given = (fields.get("token") or [""])[0]
    if not hmac.compare_digest(given.encode(), token.encode()):
        return login_form(request, wrong=True)
    response = RedirectResponse("./", status_code=303)
    forwarded = request.headers.get("x-forwarded-proto", "")
    response.set_cookie(
        SESSION_COOKIE,
        _session_value(token),
        max_age=SESSION_MAX_AGE_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https" or forwarded == "https",
        path="/",
    )
    return response
