"""``ringcomm explain --html``: the page is one self-contained document whose data holds
every round, and, opened in a real headless browser (Debian's chromium and chromedriver,
which .ci/run installs), it runs without script errors, steps and plays to the last round
and shows every rank's final buffers. Without selenium, chromium or chromedriver the browser
test skips and says which is missing."""

from __future__ import annotations

import json
import re
import shutil
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringcomm.teach import Explanation, explain, hosts_layout
from ringcomm.teach.page import _json, page
from ringcomm.teach.text import shown

CASES: dict[str, dict[str, Any]] = {
    "ring-allreduce-4": dict(algorithm="ring", world_size=4),
    "hd-allreduce-5": dict(algorithm="hd", world_size=5),
    "hier-allreduce-2x2": dict(algorithm="hier", hosts=hosts_layout("2x2")),
    "binomial-broadcast-5": dict(collective="broadcast", algorithm="binomial", world_size=5),
}
# the parser's checks also cover buffers only some ranks hold and a rooted reduce's scratch
PARSED = {**CASES, "gather-3": dict(collective="gather", world_size=3),
          "reduce-3-root-1": dict(collective="reduce", world_size=3, root=1)}
VOID = {"meta", "link", "br", "hr", "img", "input", "source", "wbr", "col", "area", "base"}


class Parsed(HTMLParser):
    """Every start tag with its attributes, the JSON blob's text, and the tags left open
    or closed out of order (none in a well-formed page)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.blob = ""
        self.errors: list[str] = []
        self._open: list[str] = []
        self._in_blob = False
        self.feed(text)
        self.close()
        self.errors += [f"<{tag}> never closed" for tag in self._open]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_blob = tag == "script" and dict(attrs).get("id") == "explain-data"
        if tag not in VOID:
            self._open.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        self._in_blob = False
        if not self._open or self._open[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self._open[-1] if self._open else ''}>")
        else:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._in_blob:
            self.blob += data


@pytest.fixture(scope="module", params=list(PARSED))
def case(request: pytest.FixtureRequest) -> tuple[Explanation, str]:
    ex = explain(**PARSED[request.param])
    return ex, page(ex)


def test_page_is_well_formed_and_self_contained(case: tuple[Explanation, str]) -> None:
    ex, text = case
    parsed = Parsed(text)
    assert parsed.errors == []
    assert text.startswith("<!DOCTYPE html>")
    for tag, attrs in parsed.tags:
        for name in ("src", "href", "xlink:href"):
            value = attrs.get(name) or ""
            assert not re.match(r"\s*(https?:)?//", value), f"<{tag} {name}={value!r}>"
        assert tag != "link", "the page links to something"
        assert not (tag == "script" and "src" in attrs), "the page loads a script"
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", text), "CSS fetches something"
    assert "@import" not in text
    svgs = [attrs for tag, attrs in parsed.tags if tag == "svg"]
    assert [a.get("data-round") for a in svgs] == [str(r.number) for r in ex.rounds]
    ids = [attrs["id"] for _, attrs in parsed.tags if attrs.get("id")]
    assert len(ids) == len(set(ids)), "ids repeat (a marker id shared between rounds?)"
    for needed in ("round-counter", "step", "back", "play", "buffer-rows", "errors"):
        assert needed in ids


def test_page_data_holds_every_round_and_the_results(case: tuple[Explanation, str]) -> None:
    ex, text = case
    data = json.loads(Parsed(text).blob)
    assert [r["number"] for r in data["rounds"]] == [r.number for r in ex.rounds]
    assert data["last"] == ex.rounds[-1].number
    role = ex.call.spec.result
    rows = [(row["rank"], row["role"]) for row in data["rows"]]
    final = data["rounds"][-1]["buffers"]
    for rank, result in enumerate(ex.results):
        if result is None:
            assert (rank, role) not in rows
            continue
        values = final[rows.index((rank, role))]["values"]
        assert [int(v) for v in values] == result.tolist()
    for k, rnd in enumerate(ex.rounds):  # each row: the round's values, None where unknown
        for (rank, role), buf in zip(rows, data["rounds"][k]["buffers"], strict=True):
            known = rnd.known[rank][role]
            assert [v is not None for v in buf["values"]] == known.tolist()
            assert np.array_equal(np.array([int(v) for v in buf["values"] if v is not None]),
                                  rnd.buffers[rank][role][known])
        assert len(data["rounds"][k]["moves"]) == len(rnd.transfers) + len(rnd.copies)


def test_page_json_cannot_end_its_script() -> None:
    nasty = {"a": "</script><script>alert(1)</script><!-- & >"}
    text = _json(nasty)
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == nasty


# --- in a browser ------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = "Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; " \
    ".ci/run installs them)"


@pytest.fixture(scope="module")
def browser() -> Any:
    """One headless chromium for the module, quit however the tests end."""
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="the explain page's browser test needs selenium "
        "(pip install -e '.[test]')")
    if CHROMIUM is None or CHROMEDRIVER is None:
        which = "chromium" if CHROMIUM is None else "chromedriver"
        pytest.skip(f"no {which} on PATH: the explain page's browser test needs {MISSING}")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # a driver path of our own: Selenium Manager never looks for (or downloads) one
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _until(check: Any, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {seconds} s waiting for {what}")
        time.sleep(0.02)


def _problems(driver: Any) -> list[str]:
    """The page's recorded script errors and the browser's SEVERE log entries."""
    errors = driver.execute_script("return window.explainErrors || ['no explainErrors']")
    return list(errors) + [e["message"] for e in driver.get_log("browser")
                           if e["level"] == "SEVERE"]


def _cells(driver: Any) -> dict[tuple[int, str], list[str]]:
    """The buffer table as the page shows it: each row's cell texts, in index order."""
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll('#buffer-rows td')).map(function (td) {"
        " return [td.dataset.rank, td.dataset.role, td.dataset.index, td.textContent]; });")
    out: dict[tuple[int, str], list[str]] = {}
    for rank, role, index, text in rows:
        cells = out.setdefault((int(rank), role), [])
        assert int(index) == len(cells)
        cells.append(text)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(CASES))
def test_page_in_a_browser(browser: Any, name: str, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    ex = explain(**CASES[name])
    path = tmp_path / f"{name}.html"
    path.write_text(page(ex), encoding="utf-8")
    browser.get(path.as_uri() + "#interval=30")  # play shows a round for 30 ms
    _until(lambda: browser.execute_script("return document.body.dataset.ready") == "1"
           or browser.execute_script("return (window.explainErrors || []).length"),
           "the page's script to start")
    assert _problems(browser) == []

    def counter() -> str:  # the counter's text, checked against the round in view
        text, figure = browser.execute_script(
            "return [document.getElementById('round-counter').textContent,"
            " document.querySelector('.round-figure:not([hidden]) svg').dataset.round];")
        assert text.split()[1] == figure
        return str(text)

    step, back, play = (browser.find_element(By.ID, i) for i in ("step", "back", "play"))
    body = browser.find_element(By.TAG_NAME, "body")
    last = ex.rounds[-1].number
    seen = [counter()]
    for _ in ex.rounds[1:]:
        step.click()
        seen.append(counter())
    assert seen == [f"round {r.number} of {last}" for r in ex.rounds]
    step.click()  # at the last round: stays there
    body.send_keys(Keys.ARROW_RIGHT)
    assert counter() == seen[-1]
    if len(ex.rounds) > 1:
        back.click()
        assert counter() == seen[-2]
        body.send_keys(Keys.ARROW_RIGHT)
        assert counter() == seen[-1]

    cells = _cells(browser)  # the final buffers, read off the page
    role = ex.call.spec.result
    for rank, result in enumerate(ex.results):
        if result is not None:
            assert cells[(rank, role)] == [str(v) for v in result.tolist()], f"rank {rank}"
    assert list(cells) == [(rank, r) for rank in range(ex.call.world_size) for r in ex.roles
                           if shown(ex, rank, r)]
    assert _problems(browser) == []

    # play from the start runs to the last round on its own and stops there
    browser.refresh()
    play = browser.find_element(By.ID, "play")
    assert counter() == seen[0]
    play.click()  # (at 30 ms a round it may be over before its label could be read)
    _until(lambda: counter() == seen[-1] and play.text == "play", "play to reach the end")
    assert _problems(browser) == []


@pytest.mark.timeout(60)
def test_page_pause_holds_the_round(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    ex = explain(algorithm="ring", world_size=4)  # 7 rounds: 1.5 s of play at 250 ms each
    path = tmp_path / "ring.html"
    path.write_text(page(ex), encoding="utf-8")
    browser.get(path.as_uri() + "#interval=250")
    play = browser.find_element(By.ID, "play")
    play.click()
    assert play.text == "pause"
    play.click()
    held = browser.find_element(By.ID, "round-counter").text
    assert play.text == "play"
    time.sleep(0.4)  # more than a round's time
    assert browser.find_element(By.ID, "round-counter").text == held
    assert held != f"round {ex.rounds[-1].number} of {ex.rounds[-1].number}"
    assert _problems(browser) == []
