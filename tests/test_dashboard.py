"""The live dashboard at ``/``: its files are served without the token (they hold no data) with headers
that keep other sites out, its data only with the token; and end to end in real headless Chromium
(Debian's ``chromium`` and ``chromium-driver``, driven by Selenium) against a running two-stage swarm:
the page shows every peer and a loss curve that grows, takes the token off the address bar, and fits
a phone's screen."""

from __future__ import annotations

import os
import shutil
import urllib.request

import pytest

from p2pswarm.api.dashboard import ASSETS
from tests.procs import Swarm, small_batch_run, wait_until
from tests.test_api import http, running_api

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TOKEN = "dash-s3cret"


async def _stats(params: dict) -> dict:
    return {"peer_id": "12D3KooWme", "role": "join"}


def test_the_page_and_its_files_need_no_token_but_the_data_does():
    with running_api({"/api/stats": _stats}, token=TOKEN) as address:
        for path in ASSETS:
            with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as response:
                body, headers = response.read(), response.headers
            assert response.status == 200 and body, path
            assert "default-src 'self'" in headers["content-security-policy"]
            assert headers["x-content-type-options"] == "nosniff"
        assert http(address, "/api/stats")[0] == 401
        assert http(address, "/api/stats", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert http(address, "/index.html")[0] == 401  # not a dashboard file: the token rule as before
        assert http(address, "/", method="POST", data=b"{}")[0] == 401


def test_the_page_loads_only_files_the_node_serves():
    with running_api({"/api/stats": _stats}) as address:
        page = http(address, "/")[1].decode()
    for path in ("/uPlot.min.js", "/uPlot.min.css", "/dashboard.js", "/dashboard.css"):
        assert f'"{path}"' in page and path in ASSETS
    assert "http://" not in page.replace("https://github.com/leeoniya/uPlot", "")  # nothing fetched from elsewhere


def _browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (os.path.exists(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=390,844"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))


def _serving(api: str) -> bool:
    """The node's API answers (the page is served without the token)."""
    try:
        with urllib.request.urlopen(f"http://{api}/", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _page(driver) -> dict:
    return driver.execute_script(
        "return {peers: [...document.querySelectorAll('tr.peer-row')].map(r => r.dataset.peer),"
        " paths: [...document.querySelectorAll('tr.peer-row .badge')].map(b => b.textContent),"
        " loss: Number(document.getElementById('loss-chart').dataset.points || 0),"
        " problem: document.getElementById('problem').hidden ? '' : document.getElementById('problem').textContent,"
        " overflow: document.documentElement.scrollWidth - window.innerWidth, url: location.href}")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_in_chromium_the_page_shows_every_peer_and_a_growing_loss_curve(tmp_path):
    pytest.importorskip("torch")
    driver = _browser(tmp_path)
    swarm = Swarm(tmp_path)
    try:
        boot = swarm.bootstrap()
        run = small_batch_run(tmp_path, "tiny-lm/2", 8)
        _, api = swarm.join(boot, "0:4", "p0", *run, "--api-token", TOKEN)
        swarm.join(boot, "4:8", "p1", *run)
        assert wait_until(lambda: _serving(api), 60), "the peer's API never answered"
        driver.get(f"http://{api}/")
        assert wait_until(lambda: "API token" in _page(driver)["problem"], 60), _page(driver)
        driver.get(f"http://{api}/#token={TOKEN}")
        first = wait_until(lambda: (lambda p: p if len(set(p["peers"])) == 2 and p["loss"] > 0 else None)(
            _page(driver)), 150)
        assert first, _page(driver)
        assert "this node" in first["paths"] and "direct" in first["paths"], first
        assert "token" not in first["url"] and not first["problem"], first
        assert wait_until(lambda: _page(driver)["loss"] > first["loss"], 60), (first, _page(driver))
        assert _page(driver)["overflow"] <= 0, "the page is wider than a phone's screen"
        logs = driver.get_log("browser")  # (the 401s of the first, token-less load are network entries)
        assert not [e for e in logs if e.get("level") == "SEVERE" and e.get("source") != "network"], logs
    finally:
        driver.quit()
        swarm.close()
