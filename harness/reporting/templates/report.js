// Aftershock HTML report: draws each run's chart with plotly.js (inlined above) and switches
// every time on the page between "seconds since launch" and the wall clock.
(function () {
  "use strict";
  var figures = [];  // {div, figure (as built, x in seconds since launch), t0, wall}
  var clock = "run";

  function wallMs(meta, x) { return (meta.t0 + x + meta.wall_offset) * 1000; }

  function convert(fig, meta) {
    // A deep copy with every x on the wall clock (ms since the epoch, a plotly date axis).
    var copy = JSON.parse(JSON.stringify(fig));
    var map = function (x) { return x === null ? null : wallMs(meta, x); };
    copy.data.forEach(function (trace) { if (trace.x) { trace.x = trace.x.map(map); } });
    (copy.layout.shapes || []).forEach(function (s) {
      if (s.xref === "x") { s.x0 = map(s.x0); s.x1 = map(s.x1); }
    });
    (copy.layout.annotations || []).forEach(function (a) {
      if (a.xref === "x") { a.x = map(a.x); }
    });
    copy.data.forEach(function (trace) {
      if (trace.hovertemplate) {
        trace.hovertemplate = trace.hovertemplate.replace(/%\{x:\.3f\}s/g, "%{x|%H:%M:%S.%L}");
      }
    });
    copy.layout.xaxis.type = "date";
    copy.layout.xaxis.title = {text: "wall clock (UTC)"};
    return copy;
  }

  function draw(entry) {
    var meta = entry.figure.layout.meta;
    var wall = clock === "wall" && meta.wall_offset !== null;
    var fig = wall ? convert(entry.figure, meta) : entry.figure;
    return Plotly.react(entry.div, fig.data, fig.layout,
                        {displaylogo: false, responsive: true});
  }

  function stamp(el) {
    var t = parseFloat(el.getAttribute("data-t"));
    var run = document.getElementById(el.getAttribute("data-run"));
    var offset = run ? run.getAttribute("data-wall-offset") : "";
    if (clock === "wall" && offset !== "") {
      var t0 = parseFloat(run.getAttribute("data-t0"));
      el.textContent = new Date((t0 + t + parseFloat(offset)) * 1000).toISOString()
        .replace("T", " ").replace("Z", "");
    } else {
      el.textContent = (t >= 0 ? "+" : "") + t.toFixed(3) + "s";
    }
  }

  function setClock(value) {
    clock = value;
    figures.forEach(draw);
    document.querySelectorAll("[data-t]").forEach(stamp);
  }

  window.aftershock = {figures: figures, setClock: setClock, ready: false};
  document.querySelectorAll("script.figure").forEach(function (node) {
    var div = document.getElementById(node.getAttribute("data-for"));
    figures.push({div: div, figure: JSON.parse(node.textContent)});
  });
  var select = document.getElementById("clock");
  if (select) { select.addEventListener("change", function () { setClock(select.value); }); }
  Promise.all(figures.map(draw)).then(function () { window.aftershock.ready = true; });
})();
