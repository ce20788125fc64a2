"""The MLflow UI as a user sees it: a real `mlflow server` over a sweep's store, opened in headless Chromium.

The user's path through the UI: pick *Model training*, add the loss and peak-memory columns to the runs table,
expand the sweep's parent run to see its trials, then open the parent's Pareto plot. Screenshots are kept under
outputs/test-artifacts/ (or $MEMFIT_TEST_ARTIFACTS).
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from memfit.tracking import default_tracking_uri
from tests.conftest import ROOT, free_port, mlflow_server, serving

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
COLUMNS = ["summary/final_loss", "summary/peak_allocated_gib"]
# As the machine's own Chromium probe starts it: no sandbox as root, and no background connections to a closed network.
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=2400,1000",
]


def _missing_browser() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path, package in [(CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")]:
        if not os.access(path, os.X_OK):
            return f"{path} not found: apt-get install chromium chromium-driver ({package})"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing_browser() is not None, reason=str(_missing_browser()))]


def artifacts_dir() -> Path:
    path = Path(os.environ.get("MEMFIT_TEST_ARTIFACTS", ROOT / "outputs" / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # Debian's driver: nothing downloaded
    try:
        yield driver
    finally:
        driver.quit()


def _tick_column(driver, key: str) -> bool:
    """One poll of the Columns tree filtered to `key`: tick the column if shown, else open collapsed groups."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    tree = driver.find_element(By.CSS_SELECTOR, "[data-testid=column-selector-tree]")
    leaf = f".//div[contains(@class,'tree-treenode')][normalize-space(.)='{key}']//span[contains(@class,'tree-title')]"
    try:
        found = tree.find_elements(By.XPATH, leaf)
        if found:
            found[0].click()
            return True
        for collapsed in tree.find_elements(By.CSS_SELECTOR, "[class*=tree-switcher_close]"):
            collapsed.click()
    except WebDriverException:  # the tree re-rendered under the click: poll again
        pass
    return False


def _table_cells(driver) -> dict[str, dict[str, str]]:
    """The runs table as shown: row (run id) → column id → the text a user reads."""
    return driver.execute_script(
        """
        const rows = {};
        for (const cell of document.querySelectorAll('[role=gridcell][col-id]')) {
          const row = cell.closest('[role=row]').getAttribute('row-id');
          (rows[row] = rows[row] || {})[cell.getAttribute('col-id')] = cell.innerText.trim();
        }
        return rows;"""
    )


def _png_size(path: Path) -> tuple[int, int]:
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the IHDR chunk
    return width, height


@pytest.mark.xdist_group("readme_budget_sweep")
def test_the_runs_table_shows_every_trial_with_loss_and_peak_and_the_pareto_plot_loads(
    readme_budget_sweep, browser, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    swept, _ = readme_budget_sweep
    store = default_tracking_uri(str(swept))
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("memfit").experiment_id
    runs = client.search_runs([experiment])
    parent = next(r for r in runs if "memfit.sweep" in r.data.tags)
    trials = {r.info.run_id: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    trained = {run_id for run_id, r in trials.items() if "summary/final_loss" in r.data.metrics}
    assert len(trials) >= 6 and trained and len(trained) < len(trials)  # some trials did not fit: no loss

    port = free_port()
    command = mlflow_server(store, port)
    wait = WebDriverWait(browser, 60)
    shots = artifacts_dir()
    with serving(command, port, cwd=tmp_path, jobs=True) as url:  # the UI as a user's server shows it
        browser.get(f"{url}/#/experiments/{experiment}")
        model_training = (By.XPATH, "//*[normalize-space(text())='Model training']")
        wait.until(ec.element_to_be_clickable(model_training)).click()
        columns = (By.CSS_SELECTOR, "[data-testid=column-selection-dropdown]")
        wait.until(ec.element_to_be_clickable(columns)).click()
        search = wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "input[placeholder='Search columns']")))
        for key in COLUMNS:
            search.send_keys(Keys.CONTROL, "a")
            search.send_keys(key)
            wait.until(lambda driver, key=key: _tick_column(driver, key))
        search.send_keys(Keys.ESCAPE)
        expand = (By.CSS_SELECTOR, f"[row-id='{parent.info.run_id}'] button[data-component-id*=runnamecell]")
        wait.until(ec.element_to_be_clickable(expand)).click()
        wait.until(lambda driver: set(trials) <= set(_table_cells(driver)))
        browser.save_screenshot(str(shots / "mlflow_ui_runs_table.png"))
        shown = _table_cells(browser)

        browser.get(f"{url}/#/experiments/{experiment}/runs/{parent.info.run_id}/artifacts/pareto.png")
        plot = wait.until(
            lambda driver: driver.execute_script(
                "return [...document.images].find(i => i.src.startsWith('blob:') && i.complete && i.naturalWidth)"
            )
        )
        loaded = browser.execute_script("return [arguments[0].naturalWidth, arguments[0].naturalHeight]", plot)
        browser.save_screenshot(str(shots / "mlflow_ui_pareto_plot.png"))

    for run_id, run in trials.items():
        row = shown[run_id]
        assert row["attributes.`Run Name`"].endswith(run.info.run_name)
        for key in COLUMNS:
            text = row[f"metrics.`{key}`"]
            if run_id in trained:
                assert float(text) == pytest.approx(run.data.metrics[key], rel=1e-6), (run.info.run_name, key)
            else:
                assert text == "-"
    pareto = Path(client.download_artifacts(parent.info.run_id, "pareto.png", str(tmp_path)))
    assert tuple(loaded) == _png_size(pareto)  # the very image the sweep logged, decoded by the browser
