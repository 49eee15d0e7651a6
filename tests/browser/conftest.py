"""Fixtures for the browser tests: the real stack and a real headless Chromium.

``stack`` runs ``rankboard up`` as a subprocess on ephemeral ports
(:class:`tests.support.browser.Stack`) with a PUSH socket that sends wire frames exactly as a
training rank does. ``page`` is a fresh Chromium page that records page errors and console
errors, so every test can assert the dashboard stayed clean.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.browser import Stack

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("rankboard-data"))
    try:
        s.start()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = None
    try:
        from playwright import sync_api
    except ImportError:
        missing = "the playwright package (pip install playwright)"
    if not Path(CHROMIUM).exists():
        missing = f"Debian's chromium at {CHROMIUM} (apt-get install chromium)"
    if missing:
        if os.environ.get("CI"):  # CI installs both: a skip there would hide lost coverage
            pytest.fail(f"browser tests need {missing}")
        pytest.skip(f"browser tests need {missing}")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class PageErrors(list):
    """Page errors and console errors seen by one page."""

    def check(self) -> None:
        assert list(self) == [], f"the page logged errors: {list(self)!r}"


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh 1440x900 page; ``page.errors`` collects page and console errors."""
    context = browser.new_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1,
                                  accept_downloads=True)
    pg = context.new_page()
    errors = PageErrors()
    pg.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    pg.on("console", lambda msg: errors.append(f"console.{msg.type}: {msg.text}")
          if msg.type == "error" else None)
    pg.errors = errors
    try:
        yield pg
    finally:
        context.close()
