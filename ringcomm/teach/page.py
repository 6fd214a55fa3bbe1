"""``ringcomm explain --html``: the rounds as one page that plays them, with back, step,
play and pause, each round's picture, its messages and every rank's buffers after it.

The page is one file with nothing to fetch (inline CSS, inline script, the SVGs embedded),
so it opens from disk, offline, and can be mailed or attached to an issue. Its data is one
JSON blob the script reads; the ids, classes and ``data-`` attributes it sets are what
tests/test_explain_page.py reads back in a browser.
"""

from __future__ import annotations

import html
import json
from typing import Any

from .explanation import Explanation
from .rounds import Round
from .svg import COPY_COLOUR, REDUCE_COLOUR, draw_one, frame
from .text import UNKNOWN, headline, result_lines, round_title, shown

INTERVAL_MS = 1200  # how long play shows a round; #interval=MS in the page's URL overrides it

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.2em; }
#controls button { font-size: 1em; min-width: 4.5em; }
#round-counter { margin-left: 1em; font-weight: bold; }
#round-title { font-size: 1em; margin: .8em 0 .3em; }
#stage { display: flex; flex-wrap: wrap; gap: 1em 2em; align-items: flex-start; }
#transfers { margin-top: 0; padding-left: 1.2em; }
.round-figure[hidden] { display: none; }
#buffers { border-collapse: collapse; font-family: monospace; }
#buffers td, #buffers th { border: 1px solid #ccc; padding: .15em .5em; text-align: right; }
#buffers td.unknown { color: #999; }
#buffers td.changed { background: #ffd48a; font-weight: bold; }
#errors { color: #b00; white-space: pre-wrap; }
.note { color: #555; font-size: .9em; }
"""

# Registered before the page's own script, so that even a syntax error in it is recorded.
_CATCH = """
window.explainErrors = [];
function explainError(text) {
  window.explainErrors.push(text);
  var box = document.getElementById("errors");
  if (box) { box.hidden = false; box.textContent += text + "\\n"; }
}
window.addEventListener("error", function (e) {
  explainError("error: " + e.message + " (line " + e.lineno + ")");
});
window.addEventListener("unhandledrejection", function (e) {
  explainError("unhandled rejection: " + e.reason);
});
"""

_SCRIPT = """
(function () {
  var data = JSON.parse(document.getElementById("explain-data").textContent);
  var rounds = data.rounds, at = 0, timer = null;
  var $ = function (id) { return document.getElementById(id); };

  function cell(tag, text, cls) {
    var el = document.createElement(tag);
    el.textContent = text;
    if (cls) el.className = cls;
    return el;
  }

  function show(i) {
    at = Math.max(0, Math.min(rounds.length - 1, i));
    var rnd = rounds[at];
    document.querySelectorAll(".round-figure").forEach(function (fig, k) {
      fig.hidden = k !== at;
    });
    $("round-counter").textContent = "round " + rnd.number + " of " + data.last;
    $("round-counter").dataset.index = at;
    $("round-title").textContent = rnd.title;
    var list = $("transfers");
    list.replaceChildren();
    rnd.moves.forEach(function (text) { list.appendChild(cell("li", text)); });
    var body = $("buffer-rows");
    body.replaceChildren();
    data.rows.forEach(function (row, r) {
      var tr = document.createElement("tr");
      tr.appendChild(cell("th", "rank " + row.rank));
      tr.appendChild(cell("th", row.role));
      var buf = rnd.buffers[r];
      buf.values.forEach(function (v, k) {
        var changed = buf.changed.indexOf(k) >= 0;
        var td = cell("td", v === null ? data.unknown : v,
                      (v === null ? "unknown " : "") + (changed ? "changed" : ""));
        td.dataset.rank = row.rank;
        td.dataset.role = row.role;
        td.dataset.index = k;
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
    $("back").disabled = at === 0;
    $("step").disabled = at === rounds.length - 1;
  }

  function pause() {
    clearInterval(timer);
    timer = null;
    $("play").textContent = "play";
    $("play").setAttribute("aria-pressed", "false");
  }

  function interval() {  // milliseconds a round stays when playing: #interval=MS or the default
    var hash = /interval=(\\d+)/.exec(location.hash);
    return hash ? Number(hash[1]) : Number(document.body.dataset.interval);
  }

  function play() {
    if (at === rounds.length - 1) show(0);  // from the end, play starts over
    $("play").textContent = "pause";
    $("play").setAttribute("aria-pressed", "true");
    timer = setInterval(function () {
      show(at + 1);
      if (at === rounds.length - 1) pause();
    }, interval());
  }

  function toggle() { if (timer) pause(); else play(); }

  $("back").addEventListener("click", function () { pause(); show(at - 1); });
  $("step").addEventListener("click", function () { pause(); show(at + 1); });
  $("play").addEventListener("click", toggle);
  document.addEventListener("keydown", function (e) {
    if (e.key === "ArrowLeft") { pause(); show(at - 1); }
    else if (e.key === "ArrowRight") { pause(); show(at + 1); }
    else if (e.key === " " && e.target.tagName !== "BUTTON") { e.preventDefault(); toggle(); }
  });
  show(0);
  document.body.dataset.ready = "1";
})();
"""


def page(ex: Explanation) -> str:
    """``ex`` as one self-contained HTML document that plays its rounds."""
    fr = frame(ex)  # the geometry, made once for every round's picture
    figures = "\n".join(
        f'<div class="round-figure" data-index="{i}"{" hidden" if i else ""}>\n'
        f"{draw_one(ex, rnd, fr)}\n</div>" for i, rnd in enumerate(ex.rounds))
    title = html.escape(headline(ex))
    result = html.escape("\n".join(result_lines(ex)))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>ringcomm explain: {title}</title>
<style>{_STYLE}</style>
<script>{_CATCH}</script>
</head>
<body data-interval="{INTERVAL_MS}">
<h1 id="headline">{title}</h1>
<p class="note">Rank r starts with (r + 1) * (i + 1) at element i.
<span style="color: {REDUCE_COLOUR}">An orange arrow</span> is a message added into the
receiver's buffer, <span style="color: {COPY_COLOUR}">a blue one</span> a message copied over
it; under each rank, its result buffer. In the table, &lsquo;{html.escape(UNKNOWN)}&rsquo; is
an element not written yet, a highlighted one was written in this round.
Keys: left and right arrows step, space plays and pauses.</p>
<div id="errors" hidden></div>
<div id="controls">
<button id="back" type="button">back</button>
<button id="step" type="button">step</button>
<button id="play" type="button" aria-pressed="false">play</button>
<span id="round-counter"></span>
</div>
<h2 id="round-title"></h2>
<div id="stage">
<div id="figures">
{figures}
</div>
<div>
<ul id="transfers"></ul>
<table id="buffers"><tbody id="buffer-rows"></tbody></table>
</div>
</div>
<pre id="result">{result}</pre>
<script type="application/json" id="explain-data">{_json(data(ex))}</script>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def data(ex: Explanation) -> dict[str, Any]:
    """What the page's script reads: the rows of its table (a rank's buffer each, unused
    scratch left out) and, for every round, its title, its messages and copies, and each
    row's values after it (``None`` where not written yet) with the indices it wrote.
    Values are strings, so that no 64-bit integer is rounded by a JavaScript number."""
    rows = [(rank, role) for rank in range(ex.call.world_size) for role in ex.roles
            if shown(ex, rank, role)]
    out: list[dict[str, Any]] = []
    previous: Round | None = None
    for rnd in ex.rounds:
        moves = [t.describe() for t in rnd.transfers]
        moves += [f"rank {c.rank} copies {c.src} into {c.dst}" for c in rnd.copies]
        buffers = []
        for rank, role in rows:
            values = rnd.buffers[rank][role]
            known = rnd.known[rank][role]
            buffers.append({
                "values": [str(v) if k else None
                           for v, k in zip(values.tolist(), known.tolist(), strict=True)],
                "changed": [int(i) for i in rnd.changed(rank, previous, role).nonzero()[0]]})
        out.append({"number": rnd.number, "title": round_title(rnd, ex), "moves": moves,
                    "buffers": buffers})
        previous = rnd
    return {"last": ex.rounds[-1].number, "unknown": UNKNOWN,
            "rows": [{"rank": rank, "role": role} for rank, role in rows], "rounds": out,
            "results": [None if r is None else [str(v) for v in r.tolist()]
                        for r in ex.results]}


def _json(value: object) -> str:
    """``value`` as JSON safe inside a ``<script>``: every ``<``, ``>`` and ``&`` (which
    JSON holds only inside strings) written as a ``\\u`` escape, so no ``</script>`` or
    ``<!--`` in a label can end the element or change how it is read."""
    text = json.dumps(value, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
