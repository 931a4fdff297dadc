"""The API documentation pages, ``/docs`` (Swagger UI) and ``/redoc``, with their scripts and
styles served by this server from the ``fastapi-offline`` package: FastAPI's defaults load them
from a CDN (and web fonts from another host), which a cluster with no way out cannot reach."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from weightserve.service.transports.http.routes import get_and_head

ASSETS_URL = "/docs/assets"
ASSETS_PACKAGE = ("fastapi_offline", "static")  # swagger-ui-bundle.js, swagger-ui.css, redoc…


def add_offline_docs(app: FastAPI) -> None:
    """Add ``/docs``, ``/redoc`` and their assets to an app created with ``docs_url=None``
    and ``redoc_url=None`` (FastAPI's own pages would point at the CDN)."""
    app.mount(ASSETS_URL, StaticFiles(packages=[ASSETS_PACKAGE]), name="docs-assets")

    def add_page(path: str, render: Callable[[str, str], HTMLResponse]) -> None:
        """Serve ``render(openapi_url, assets_url)`` at ``path``."""

        @get_and_head(app, path, include_in_schema=False)
        def page(request: Request) -> HTMLResponse:
            root = request.scope.get("root_path", "").rstrip("/")  # behind a path-prefix proxy
            return render(f"{root}{app.openapi_url}", f"{root}{ASSETS_URL}")

    add_page(
        "/docs",
        lambda openapi, assets: get_swagger_ui_html(
            openapi_url=openapi,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon.png",
            # Swagger UI would otherwise send the spec to the public validator for a badge.
            swagger_ui_parameters={"validatorUrl": None},
        ),
    )
    add_page(
        "/redoc",
        lambda openapi, assets: get_redoc_html(
            openapi_url=openapi,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{assets}/redoc.standalone.js",
            redoc_favicon_url=f"{assets}/favicon.png",
            with_google_fonts=False,
        ),
    )
