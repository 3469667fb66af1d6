/* dl4py's training page: the charts of `dl4py ui` (live, polling the server) and of
 * `dl4py report` (the same page with its data inlined). One file draws both.
 *
 * Data, in both cases one object: {title, points, runs: [run info], sweep: sweep info | null,
 * metrics: [{records, offset, reset, more, seen, notes}]} with one metrics chunk per run: the
 * records of its metrics.jsonl from the offset the page asked for, each kind thinned to
 * `points` (seen: how many each kind had), notes on lines skipped (see dl4py/monitor/runs.py).
 * The page keeps at most twice `points` of each series, and says when it shows fewer than
 * a run wrote.
 *
 *   DL4PY.start({poll: "api/poll", every: 2000})   // live: polls, adds new points in place
 *   DL4PY.start({data: {...}})                      // report: draws once
 *
 * DL4PY.charts maps each chart's id to its Chart.js object (tests read them).
 */
(function () {
  "use strict";

  var COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                "#7f7f7f", "#bcbd22"];
  // DL4J's rule of thumb for the update:parameter ratio: about 1e-3 (log10 -3).
  var RATIO_TARGET = -3;

  var SERIES = ["stats", "iteration", "epoch"];
  var NOTES_KEPT = 10;  // per run: a file full of bad lines must not fill the page

  var DL4PY = window.DL4PY = {charts: {}, state: null, polls: 0};
  var state = DL4PY.state = {runs: [], sweep: null, selected: 0, userSelected: false, sort: null, title: "",
                             points: 0};

  // -- the charts: what each shows, where its points come from -------------------------

  function layerNames(run) {
    var names = [];
    var stat = run.static;
    if (stat && stat.model && stat.model.layers) names = stat.model.layers.slice();
    run.stats.forEach(function (r) {
      Object.keys(r.layers || {}).forEach(function (n) { if (names.indexOf(n) < 0) names.push(n); });
    });
    return names;
  }

  function perLayer(field, transform) {
    return function (runs) {
      var run = runs[state.selected];
      if (!run) return [];
      return layerNames(run).map(function (name, i) {
        var points = [];
        run.stats.forEach(function (r) {
          var layer = (r.layers || {})[name];
          var v = layer ? layer[field] : null;
          if (v !== null && v !== undefined && v > 0) points.push({x: r.iteration, y: transform ? transform(v) : v});
        });
        return {label: name, data: points, color: COLORS[i % COLORS.length]};
      });
    };
  }

  function perRun(source, x, y, options) {
    options = options || {};
    return function (runs) {
      var sets = [];
      runs.forEach(function (run, i) {
        var records = source(run);
        var points = [];
        records.forEach(function (r) {
          var xv = x(r), yv = y(r);
          if (isNumber(xv) && isNumber(yv) && (!options.positive || yv > 0)) points.push({x: xv, y: yv});
        });
        sets.push({label: runLabel(run), data: points, color: COLORS[i % COLORS.length], dashed: options.dashed});
      });
      return sets;
    };
  }

  function stepRecords(run) { return run.stats.length ? run.stats : run.iteration; }
  function statsOrEpochs(run) { return run.stats.length ? run.stats : run.epoch; }
  function epochNumber(r) { return r.epoch + 1; }
  function mib(bytes) { return isNumber(bytes) ? bytes / (1024 * 1024) : null; }

  function validationKeys(runs) {
    var keys = [];
    runs.forEach(function (run) {
      run.epoch.forEach(function (r) {
        Object.keys(r).forEach(function (k) {
          if (k.indexOf("val_") === 0 && k !== "val_loss" && keys.indexOf(k) < 0 && isNumber(r[k])) keys.push(k);
        });
      });
    });
    return keys;
  }

  // x, y: the axes' titles; yLog: log where the data spans a decade (see "axes" below).
  var CHARTS = [
    {id: "score", section: "overview", title: "Score (minibatch loss) vs iteration",
     help: "Should fall, with noise. Flat from the start: the learning rate is too low or the data is not " +
           "reaching the network. Rising or NaN: too high.",
     x: "iteration", y: "score", datasets: perRun(stepRecords, function (r) { return r.iteration; },
                                                  function (r) { return r.score; })},
    {id: "epoch_loss", section: "overview", title: "Loss per epoch: training (solid), validation (dashed)",
     help: "Validation loss rising while training loss falls: over-fitting; stop earlier or regularise.",
     x: "epoch", y: "loss", datasets: function (runs) {
       return perRun(function (r) { return r.epoch; }, epochNumber, function (r) { return r.loss; })(runs).concat(
         perRun(function (r) { return r.epoch; }, epochNumber, function (r) { return r.val_loss; },
                {dashed: true})(runs).filter(function (s) { s.label += " (validation)"; return s.data.length; }));
     }},
    {id: "validation", section: "overview", title: "Validation metrics per epoch",
     help: "The held-out score after each epoch (data.validation): what early stopping and a sweep rank by.",
     x: "epoch", y: "value", datasets: function (runs) {
       var sets = [];
       validationKeys(runs).forEach(function (key, k) {
         perRun(function (r) { return r.epoch; }, epochNumber, function (r) { return r[key]; },
                {dashed: k > 0})(runs).forEach(function (s) { s.label += " " + key; sets.push(s); });
       });
       return sets;
     }},
    {id: "learning_rate", section: "overview", title: "Learning rate", x: "iteration", y: "learning rate",
     help: "The rate the updater used, schedules included.", yLog: true,
     datasets: perRun(statsOrEpochs, function (r) { return r.iteration; }, function (r) { return r.learning_rate; },
                      {positive: true})},
    {id: "throughput", section: "overview", title: "Throughput (samples/s) over time", x: "seconds", y: "samples/s",
     help: "Dips: data loading, checkpoints or other processes on the machine. A steady fall: memory pressure.",
     datasets: perRun(statsOrEpochs, function (r) { return r.time; }, function (r) { return r.samples_per_second; })},
    {id: "memory", section: "overview", title: "Memory over time: process (solid), device allocated (dashed)",
     x: "seconds", y: "MiB",
     help: "Growing without bound: something keeps tensors alive (a leak). Device memory near its total: a " +
           "larger batch will not fit.",
     datasets: function (runs) {
       var memory = function (r) { return r.memory || {}; };
       var rss = perRun(function (r) { return r.stats; }, function (r) { return r.time; },
                        function (r) { return mib(memory(r).process_rss_bytes); })(runs);
       var device = perRun(function (r) { return r.stats; }, function (r) { return r.time; },
                           function (r) { return mib(memory(r).device_allocated_bytes); }, {dashed: true})(runs);
       device.forEach(function (s) { s.label += " (device)"; });
       return rss.concat(device.filter(function (s) { return s.data.length; }));
     }},
    {id: "update_ratio", section: "run", title: "Update:parameter ratio per layer (log10)", x: "iteration",
     y: "log10(update:parameter)", refLine: RATIO_TARGET,
     help: "DL4J's rule of thumb: about -3 (dashed line). Well above (-2 or more): the learning rate is too " +
           "high and training may be unstable. Well below (-4 or less): the layer learns too slowly.",
     datasets: perLayer("update_ratio", Math.log10)},
    {id: "parameters", section: "run", title: "Mean |parameter| per layer", x: "iteration", y: "mean |value|",
     yLog: true, help: "Should drift slowly. Growing fast: exploding weights; add l2 or lower the rate.",
     datasets: perLayer("parameters")},
    {id: "gradients", section: "run", title: "Mean |gradient| per layer", x: "iteration", y: "mean |value|",
     yLog: true,
     help: "Orders of magnitude apart between layers, or falling towards 0 in the first layers: vanishing " +
           "gradients. Jumping up: exploding gradients (clip them or lower the rate).",
     datasets: perLayer("gradients")},
    {id: "activations", section: "run", title: "Mean |activation| per layer", x: "iteration", y: "mean |value|",
     yLog: true,
     help: "Falling to 0: dead units (e.g. ReLU); growing without bound: unstable training.",
     datasets: perLayer("activations")},
  ];

  // -- chart drawing -----------------------------------------------------------------

  // Draws DL4J's target ratio as a dashed line across the chart.
  var refLinePlugin = {
    id: "dl4pyRefLine",
    afterDatasetsDraw: function (chart) {
      var value = chart.options.plugins.dl4pyRefLine && chart.options.plugins.dl4pyRefLine.value;
      if (value === undefined || value === null) return;
      var y = chart.scales.y, area = chart.chartArea;
      if (value < y.min || value > y.max) return;
      var pixel = y.getPixelForValue(value), ctx = chart.ctx;
      ctx.save();
      ctx.strokeStyle = "#444";
      ctx.setLineDash([6, 4]);
      ctx.beginPath();
      ctx.moveTo(area.left, pixel);
      ctx.lineTo(area.right, pixel);
      ctx.stroke();
      ctx.restore();
    }
  };

  function toChartDatasets(sets, type) {
    return sets.map(function (s) {
      return {
        label: s.label, data: s.data, borderColor: s.color, backgroundColor: s.color,
        borderDash: s.dashed ? [6, 4] : [], borderWidth: 1.5, pointRadius: s.data.length > 40 ? 0 : 2,
        showLine: type !== "scatter", parsing: false, normalized: true, tension: 0
      };
    });
  }

  function lineOptions(spec, sets) {
    var x = axisOptions(spec.x, spec.xLog && spansDecades(sets, "x"), {
      integer: spec.xInteger || spec.x === "epoch" || spec.x === "iteration", categories: spec.categories});
    var y = axisOptions(spec.y, spec.yLog && spansDecades(sets, "y"), {});
    // A reference line stays in view (with room around it), however far the data is from it.
    if (isNumber(spec.refLine)) {
      y.suggestedMin = spec.refLine - 0.5;
      y.suggestedMax = spec.refLine + 0.5;
    }
    return {
      animation: false, responsive: true, maintainAspectRatio: false, parsing: false, normalized: true,
      interaction: {mode: "nearest", intersect: false},
      scales: {x: x, y: y},
      plugins: {
        legend: {position: "bottom", labels: {boxWidth: 12}},
        decimation: {enabled: true, algorithm: "lttb", samples: 500, threshold: 1000},
        dl4pyRefLine: {value: spec.refLine}
      }
    };
  }

  function drawChart(spec, sets, type) {
    var card = document.getElementById("card-" + spec.id);
    var hasData = sets.some(function (s) { return s.data.length > 0; });
    card.hidden = !hasData;
    if (!hasData) return;
    sets = sets.filter(function (s) { return s.data.length > 0; });
    var chart = DL4PY.charts[spec.id];
    var options = lineOptions(spec, sets);
    // What decides the axes' options: new data can turn an axis log, or bring a category.
    var axes = JSON.stringify([options.scales.x.type, options.scales.y.type, spec.categories || null]);
    if (!chart) {
      chart = DL4PY.charts[spec.id] = new Chart(card.querySelector("canvas"), {
        type: type || "line", data: {datasets: toChartDatasets(sets, type)}, options: options,
        plugins: [refLinePlugin]
      });
      chart.dl4pyAxes = axes;
      return;
    }
    if (chart.dl4pyAxes !== axes) {
      chart.options = options;
      chart.dl4pyAxes = axes;
    }
    chart.data.datasets = toChartDatasets(sets, type);
    chart.update("none");
  }

  // -- axes: their range and their ticks ----------------------------------------------
  //
  // Each axis of a line or scatter chart spans its data and PAD of that range more on
  // either side, so no point sits on the frame, and carries ticks placed here rather than
  // by Chart.js (whose log axis wrote "0.100" over "0.080"): as many as fit TICK_SPACE
  // pixels apart, and at least MIN_TICKS, closer where that takes it (a label is about 15
  // pixels high); on a linear axis the multiples of a 1, 2 or 5 x 10^k step, on a log axis
  // 1, 2 and 5 x 10^k only (whole decades, or every n-th one, where those would crowd).
  // A chart that asks for a log axis (yLog, xLog) gets one where its data spans at least
  // a decade: over less, a log axis has room for one or two such labels, and a linear one
  // shows the same drift with five. Chart.js's autoSkip stays on as the last guard.

  var PAD = 0.05;
  var MIN_TICKS = 4;
  var TICK_SPACE = {x: 72, y: 28};  // a label's width (x), a line of text and a gap (y)
  var LOG_FROM = 10;  // the data's max / min from which an axis asked to be log is drawn log
  var MANTISSAS = [1, 2, 5];

  function spansDecades(sets, key) {
    var low = Infinity, high = -Infinity;
    sets.forEach(function (s) {
      s.data.forEach(function (p) {
        if (p[key] > 0) { low = Math.min(low, p[key]); high = Math.max(high, p[key]); }
      });
    });
    return high / low >= LOG_FROM;
  }

  // options: integer (no tick between whole numbers), categories (names of 0, 1, ...).
  function axisOptions(title, log, options) {
    var categories = options.categories;
    return {
      type: log ? "logarithmic" : "linear", bounds: "data",
      title: {display: true, text: title + (log ? " (log scale)" : "")},
      ticks: {maxRotation: 0, callback: function (value) {
        if (categories) return categories[value];
        return this.dl4pyLabel ? this.dl4pyLabel(value) : String(value);
      }},
      afterDataLimits: function (axis) {
        if (categories) {  // each category a whole step from the frame
          axis.min = -0.5;
          axis.max = categories.length - 0.5;
        } else {
          padLimits(axis);
        }
      },
      afterBuildTicks: function (axis) {
        placeTicks(axis, options.integer || !!categories);
      }
    };
  }

  function padLimits(axis) {
    var log = axis.type === "logarithmic";
    var low = log ? Math.log10(axis.min) : axis.min, high = log ? Math.log10(axis.max) : axis.max;
    if (!isFinite(low) || !isFinite(high)) return;
    var span = high - low;
    var pad = span > 0 ? span * PAD : (log ? 0.5 : Math.abs(low) * 0.1 || 1);
    axis.min = log ? Math.pow(10, low - pad) : low - pad;
    axis.max = log ? Math.pow(10, high + pad) : high + pad;
  }

  function placeTicks(axis, integer) {
    var low = axis.min, high = axis.max;
    var log = axis.type === "logarithmic";
    if (!isNumber(low) || !isNumber(high) || !(high > low) || (log && !(low > 0))) return;
    var length = axis.isHorizontal() ? axis.width : axis.height;
    var most = Math.max(MIN_TICKS, Math.floor(length / TICK_SPACE[axis.isHorizontal() ? "x" : "y"]));
    var placed = log ? logTicks(low, high, most) : linearTicks(low, high, most, integer);
    axis.min = placed.low;
    axis.max = placed.high;
    axis.ticks = placed.values.map(function (v) { return {value: v}; });
    axis.dl4pyLabel = placed.label;
  }

  // Multiples of the smallest 1-2-5 step that leaves at most `most` ticks (a smaller one
  // where that would leave fewer than MIN_TICKS).
  function linearTicks(low, high, most, integer) {
    var steps = [], top = Math.ceil(Math.log10(high - low));
    for (var k = top; k > top - 20; k--) {
      [5, 2, 1].forEach(function (m) { steps.push(Number(m + "e" + k)); });
    }
    steps = steps.filter(function (step) { return !integer || step >= 1; });
    if (!steps.length) steps = [1];
    var count = function (step) { return Math.floor(high / step) - Math.ceil(low / step) + 1; };
    var chosen = steps[0];
    for (var i = 0; i < steps.length; i++) {
      if (count(steps[i]) > most && count(chosen) >= MIN_TICKS) break;
      chosen = steps[i];
      if (count(chosen) > most) break;
    }
    var values = [];
    for (var n = Math.ceil(low / chosen); n * chosen <= high; n++) {
      values.push(Number((n * chosen).toPrecision(12)) || 0);  // || 0: no "-0"
    }
    return {low: low, high: high, values: values, label: linearLabel(values, chosen)};
  }

  function linearLabel(values, step) {
    var size = Math.max.apply(null, values.map(Math.abs));
    var places = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    if (size >= 1e6 || (size > 0 && size < 1e-3)) {
      var digits = Math.max(0, Math.floor(Math.log10(size) + 1e-9) - Math.floor(Math.log10(step) + 1e-9));
      return function (v) { return v === 0 ? "0" : v.toExponential(digits).replace("e+", "e"); };
    }
    return function (v) {
      return v.toLocaleString("en-US", {minimumFractionDigits: places, maximumFractionDigits: places});
    };
  }

  // 1, 2 and 5 x 10^k in [low, high], the range widened to the next such value (the
  // nearer side first) until it holds MIN_TICKS of them; sparser (every n-th decade)
  // where more than `most` would not fit.
  function logTicks(low, high, most) {
    while (oneTwoFive(low, high, 0).length < MIN_TICKS) {
      var below = stepOut(low, -1), above = stepOut(high, 1);
      if (Math.log10(low / below) <= Math.log10(above / high)) low = below; else high = above;
    }
    var values = oneTwoFive(low, high, 0);
    for (var every = 1; values.length > most; every++) {
      var sparser = oneTwoFive(low, high, every);
      if (sparser.length < MIN_TICKS) break;
      values = sparser;
    }
    // 0.001 to 5000 as written; over a wider span, what is not short so ("1e-5", "0.01", "1")
    var plain = values.every(function (v) { return v >= 1e-3 && v < 1e4; });
    return {low: low, high: high, values: values, label: function (v) {
      return plain || (v >= 0.01 && v < 1000) ? String(v) : v.toExponential(0).replace("e+", "e");
    }};
  }

  // every 0: 1, 2 and 5 x 10^k; every n: 10^k for k a multiple of n.
  function oneTwoFive(low, high, every) {
    var values = [];
    for (var k = Math.floor(Math.log10(low)) - 1; k <= Math.ceil(Math.log10(high)); k++) {
      (every ? (k % every === 0 ? [1] : []) : MANTISSAS).forEach(function (m) {
        var v = Number(m + "e" + k);
        if (v >= low * (1 - 1e-12) && v <= high * (1 + 1e-12)) values.push(v);
      });
    }
    return values;
  }

  // The next 1, 2 or 5 x 10^k past `value`, below it (direction -1) or above it (1).
  function stepOut(value, direction) {
    var k = Math.floor(Math.log10(value));
    var candidates = [];
    [k - 1, k, k + 1].forEach(function (e) {
      MANTISSAS.forEach(function (m) { candidates.push(Number(m + "e" + e)); });
    });
    var past = candidates.filter(function (v) { return direction < 0 ? v < value * (1 - 1e-12) : v > value * (1 + 1e-12); });
    return direction < 0 ? Math.max.apply(null, past) : Math.min.apply(null, past);
  }

  function drawCharts() {
    CHARTS.forEach(function (spec) { drawChart(spec, spec.datasets(state.runs)); });
    drawEvaluation(state.runs[state.selected]);
    if (state.sweep) drawSweepCharts();
  }

  // -- the selected run: evaluation, model, environment --------------------------------

  function drawEvaluation(run) {
    var evaluation = run && run.evaluation;
    var matrix = evaluation && evaluation.confusion_matrix;
    var card = document.getElementById("card-confusion");
    card.hidden = !matrix;
    if (matrix) card.querySelector(".heatmap").replaceChildren(heatmap(matrix, evaluation.class_labels));
    var classCard = document.getElementById("card-classes");
    var precision = evaluation && evaluation.class_precision, recall = evaluation && evaluation.class_recall;
    var labels = (evaluation && evaluation.class_labels) ||
                 (precision || []).map(function (_, i) { return String(i); });
    classCard.hidden = !(precision && recall);
    if (!precision || !recall) return;
    var data = {labels: labels, datasets: [
      {label: "precision", data: precision, backgroundColor: COLORS[0]},
      {label: "recall", data: recall, backgroundColor: COLORS[3]}
    ]};
    var chart = DL4PY.charts.classes;
    if (!chart) {
      DL4PY.charts.classes = new Chart(classCard.querySelector("canvas"), {type: "bar", data: data, options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        scales: {x: {title: {display: true, text: "class"}}, y: {min: 0, max: 1, title: {display: true, text: "score"}}},
        plugins: {legend: {position: "bottom", labels: {boxWidth: 12}}}
      }});
    } else {
      chart.data = data;
      chart.update("none");
    }
  }

  // The confusion matrix as a heat map: rows are the actual class, columns the predicted
  // one; each cell's colour is its share of the row (the class's recall on the diagonal).
  function heatmap(matrix, labels) {
    labels = labels || matrix.map(function (_, i) { return String(i); });
    var table = el("table", {className: "heatmap-table"});
    var head = el("tr", {}, [el("th", {className: "corner", textContent: "actual \\ predicted"})]);
    labels.forEach(function (label) { head.appendChild(el("th", {textContent: label})); });
    table.appendChild(head);
    matrix.forEach(function (row, i) {
      var total = row.reduce(function (a, b) { return a + b; }, 0) || 1;
      var tr = el("tr", {}, [el("th", {textContent: labels[i]})]);
      row.forEach(function (count, j) {
        var share = count / total;
        var cell = el("td", {textContent: String(count), title: labels[i] + " predicted as " + labels[j] + ": " +
                                                                 count + " (" + (100 * share).toFixed(1) + "%)"});
        cell.style.background = "rgba(31, 119, 180, " + share.toFixed(3) + ")";
        cell.style.color = share > 0.5 ? "#fff" : "#222";
        if (i === j) cell.className = "diagonal";
        tr.appendChild(cell);
      });
      table.appendChild(tr);
    });
    return table;
  }

  function drawRunDetails() {
    var run = state.runs[state.selected];
    var select = document.getElementById("run-select");
    select.replaceChildren.apply(select, state.runs.map(function (r, i) {
      return el("option", {value: String(i), textContent: runLabel(r), selected: i === state.selected});
    }));
    document.getElementById("run-picker").hidden = state.runs.length < 2;
    if (!run) return;
    var model = (run.static && run.static.model) || run.info.model || {};
    var summary = model.summary || "(no model summary: the run has no config.yaml and no StatsListener record)";
    if (isNumber(model.parameters) && summary.indexOf("Total parameters") < 0) {
      summary += "\nTotal parameters: " + model.parameters.toLocaleString("en-US");
    }
    document.getElementById("model-summary").textContent = summary;
    var env = Object.assign({}, (run.static && run.static.environment) || {}, run.info.environment || {});
    var workers = (run.static && run.static.workers) || run.info.result.workers;
    if (workers) env.workers = workers;
    var rows = ["backend", "device", "device_name", "precision", "workers", "cpu_threads", "torch", "cuda", "dl4py",
                "python", "platform", "backend_reason"].filter(function (k) { return env[k] !== undefined &&
                                                                                  env[k] !== null; });
    Object.keys(env).forEach(function (k) {
      if (rows.indexOf(k) < 0 && typeof env[k] !== "object") rows.push(k);
    });
    var table = document.getElementById("environment");
    table.replaceChildren.apply(table, rows.map(function (k) {
      return el("tr", {}, [el("th", {textContent: k}), el("td", {textContent: String(env[k])})]);
    }));
    document.getElementById("config-text").textContent = run.info.config || "(no config.yaml)";
    document.getElementById("details-title").textContent = state.runs.length < 2 ? runLabel(run) : "";
  }

  // -- the tables: runs, and a sweep's experiments -------------------------------------

  function drawRunTable() {
    var body = document.getElementById("runs-body");
    body.replaceChildren.apply(body, state.runs.map(function (run, i) {
      var result = run.info.result || {};
      var last = run.epoch.length ? run.epoch[run.epoch.length - 1] : {};
      var evaluation = run.evaluation || {};
      // result.json is the run's last word once it ended; a resumed run's one is older than its epochs
      var ended = run.info.status !== "running";
      var cells = [
        swatch(i, runLabel(run)), run.info.status,
        Math.max(isNumber(result.epochs) ? result.epochs : 0, run.epoch.length ? last.epoch + 1 : 0) || "",
        fmt(first(evaluation.test_accuracy, result.test_accuracy)),
        fmt(ended ? first(result.val_accuracy, last.val_accuracy) : first(last.val_accuracy, null)),
        fmt(first(last.loss, null)),
        fmt(first(result.train_samples_per_second, last.samples_per_second), 0),
        (run.info.environment || {}).backend || "", (run.info.environment || {}).device || "",
        (run.info.environment || {}).precision || ""
      ];
      var tr = el("tr", {className: i === state.selected ? "selected" : ""},
                  cells.map(function (c) { return el("td", {}, [typeof c === "object" ? c : text(c)]); }));
      tr.addEventListener("click", function () { select(i); });
      return tr;
    }));
  }

  function sweepColumns(sweep) {
    var columns = [{key: "experiment", title: "experiment"}];
    sweep.keys.forEach(function (k) { columns.push({key: "values." + k, title: k.split(".").pop(), full: k}); });
    columns.push({key: sweep.metric, title: sweep.metric + (sweep.higher_is_better ? " ↑" : " ↓"), metric: true});
    sweep.columns.forEach(function (k) { columns.push({key: k, title: k}); });
    columns.push({key: "seconds", title: "seconds"}, {key: "status", title: "status"});
    return columns;
  }

  function cellValue(row, key) {
    if (key.indexOf("values.") === 0) return row.values[key.slice(7)];
    return row[key];
  }

  function drawSweepTable() {
    var sweep = state.sweep;
    var columns = sweepColumns(sweep);
    var rows = sweep.rows.slice();  // the server's order: ranked best first
    if (state.sort) {
      var key = state.sort.key, sign = state.sort.ascending ? 1 : -1;
      rows.sort(function (a, b) { return compare(cellValue(a, key), cellValue(b, key), sign); });
    }
    var head = document.getElementById("sweep-head");
    head.replaceChildren.apply(head, columns.map(function (c) {
      var sorted = state.sort && state.sort.key === c.key;
      var th = el("th", {textContent: c.title + (sorted ? (state.sort.ascending ? " ▲" : " ▼") : ""),
                         title: (c.full || c.key) + ": click to sort"});
      th.setAttribute("aria-sort", sorted ? (state.sort.ascending ? "ascending" : "descending") : "none");
      th.dataset.key = c.key;
      th.addEventListener("click", function () {
        var ascending = state.sort && state.sort.key === c.key ? !state.sort.ascending : true;
        state.sort = {key: c.key, ascending: ascending};
        drawSweepTable();
      });
      return th;
    }));
    var body = document.getElementById("sweep-body");
    body.replaceChildren.apply(body, rows.map(function (row) {
      var index = runIndex(row.experiment);
      var tr = el("tr", {className: row === sweep.rows[0] && row.status === "completed" ? "best" : ""},
                  columns.map(function (c) {
                    var v = cellValue(row, c.key);
                    var shown = c.full ? row[c.full] : fmt(v);  // a swept value as the user wrote it
                    var content = c.key === "experiment" && index >= 0 ? swatch(index, v) : text(shown);
                    return el("td", {className: c.metric ? "metric" : "", title: c.key === "experiment" ? v : ""},
                              [content]);
                  }));
      if (row.error) tr.title = row.error;
      if (index >= 0) tr.addEventListener("click", function () { select(index); });
      return tr;
    }));
    var caption = document.getElementById("sweep-caption");
    caption.textContent = sweep.rows.length + " experiments in " + sweep.name + ", ranked by " + sweep.metric +
      " (" + (sweep.higher_is_better ? "higher" : "lower") + " is better). Click a column to sort by it, " +
      "a row to show its run below.";
  }

  // One chart per swept key: the metric of each completed experiment against its value.
  function drawSweepCharts() {
    var sweep = state.sweep;
    var holder = document.getElementById("sweep-charts");
    sweep.keys.forEach(function (key, k) {
      var id = "sweep_" + k;
      if (!document.getElementById("card-" + id)) holder.appendChild(card(id, sweep.metric + " against " + key,
        "Each point is one experiment (completed runs only)."));
      var done = sweep.rows.filter(function (r) { return r.status === "completed" && isNumber(r[sweep.metric]); });
      var numeric = done.every(function (r) { return isNumber(r.values[key]); });
      var values = done.map(function (r) { return r.values[key]; });
      var positive = numeric && values.every(function (v) { return v > 0; });
      var categories = numeric ? null : values.map(String).filter(function (v, i, all) { return all.indexOf(v) === i; });
      var points = done.map(function (r) {
        return {x: numeric ? r.values[key] : categories.indexOf(String(r.values[key])), y: r[sweep.metric]};
      });
      var spec = {id: id, x: key, y: sweep.metric, xLog: positive, categories: categories,
                  xInteger: numeric && values.every(Number.isInteger)};  // a batch size has no 15.2
      drawChart(spec, [{label: sweep.metric, data: points, color: COLORS[0]}], "scatter");
    });
  }

  // -- page state ----------------------------------------------------------------------

  function newRun(info) {
    return {info: info, static: null, stats: [], epoch: [], iteration: [], evaluation: null, offset: 0,
            seen: {}, notes: []};
  }

  function addRecords(run, chunk) {
    if (chunk.reset) {
      var fresh = newRun(run.info);
      Object.keys(fresh).forEach(function (k) { run[k] = fresh[k]; });
    }
    chunk.records.forEach(function (r) {
      if (r.kind === "static") run.static = r;
      else if (r.kind === "evaluation") run.evaluation = r;
      else if (run[r.kind]) run[r.kind].push(r);
    });
    SERIES.forEach(function (kind) {
      run[kind] = thinned(run[kind], state.points);
      run.seen[kind] = (run.seen[kind] || 0) + ((chunk.seen || {})[kind] || 0);
    });
    (chunk.notes || []).forEach(function (note) { if (run.notes.length < NOTES_KEPT) run.notes.push(note); });
    run.offset = chunk.offset;
    return chunk.records.length > 0 || chunk.reset || (chunk.notes || []).length > 0;
  }

  // A live page's series past twice the limit loses every other point (the last one stays),
  // so a run followed for days costs the page what a short one does.
  function thinned(points, limit) {
    if (!limit || points.length <= 2 * limit) return points;
    return points.filter(function (_, i) { return (points.length - 1 - i) % 2 === 0; });
  }

  function apply(data) {
    state.title = data.title;
    state.points = data.points || 0;
    document.title = data.title;
    document.getElementById("title").textContent = data.title;
    var changed = false, replaced = false;
    data.runs.forEach(function (info, i) {
      // Another run in this place (a storage detached from the UI, another attached): its
      // chunk was read from the old run's offset, so it starts afresh from the next poll.
      var other = state.runs[i] && state.runs[i].info.key !== info.key;
      if (!state.runs[i] || other) state.runs[i] = newRun(info);
      var run = state.runs[i];
      if (JSON.stringify(run.info) !== JSON.stringify(info)) changed = true;
      run.info = info;
      if (other) changed = replaced = true;
      else if (data.metrics && data.metrics[i] && addRecords(run, data.metrics[i])) changed = true;
    });
    if (state.runs.length > data.runs.length) {  // detached: the last places are gone
      state.runs.length = data.runs.length;
      changed = true;
    }
    if (state.selected >= state.runs.length) {
      state.selected = 0;
      state.userSelected = false;
    }
    if (JSON.stringify(state.sweep) !== JSON.stringify(data.sweep || null)) changed = true;
    state.sweep = data.sweep || null;
    if (!changed && DL4PY.polls > 0) return false;
    if (!state.userSelected) state.selected = defaultRun();
    document.getElementById("sweep").hidden = !state.sweep;
    if (state.sweep) drawSweepTable();
    drawRunTable();
    drawRunDetails();
    drawCharts();
    drawNotes();
    shadeTables();
    return replaced;
  }

  // A table wider than its box scrolls inside it; its box is shaded on the right while
  // columns are hidden that way (dashboard.css).
  function shadeTables() {
    document.querySelectorAll(".table-box").forEach(function (box) {
      var scroll = box.querySelector(".scroll");
      box.classList.toggle("more-right", scroll.scrollLeft + scroll.clientWidth < scroll.scrollWidth - 1);
    });
  }

  // What the page does not show: series thinned, lines skipped, files left out.
  function drawNotes() {
    var notes = [];
    state.runs.forEach(function (run) {
      var name = runLabel(run);
      SERIES.forEach(function (kind) {
        var seen = run.seen[kind] || 0, shown = run[kind].length;
        if (seen > shown) {
          notes.push(name + ": showing " + count(shown) + " of " + count(seen) + " points of its \"" + kind +
                     "\" records (evenly spread, the last one kept)");
        }
      });
      run.notes.concat(run.info.notes || []).forEach(function (note) { notes.push(name + ": " + note); });
    });
    var list = document.getElementById("notes");
    list.replaceChildren.apply(list, notes.map(function (note) { return el("li", {textContent: note}); }));
    list.hidden = notes.length === 0;
  }

  // Until the user picks one, the run shown in detail is a sweep's best, else the first
  // with per-layer stats.
  function defaultRun() {
    var best = state.sweep && state.sweep.rows[0];
    if (best && best.status === "completed" && runIndex(best.experiment) >= 0) return runIndex(best.experiment);
    for (var i = 0; i < state.runs.length; i++) if (state.runs[i].stats.length) return i;
    for (i = 0; i < state.runs.length; i++) if (state.runs[i].evaluation) return i;
    return 0;
  }

  function select(index) {
    state.selected = index;
    state.userSelected = true;
    drawRunTable();
    drawRunDetails();
    drawCharts();
    document.getElementById("details").scrollIntoView({behavior: "smooth", block: "start"});
  }

  function poll(options) {
    var offsets = state.runs.map(function (r) { return r.offset; }).join(",");
    var more = false;
    fetch(options.poll + "?offsets=" + offsets, {cache: "no-store"})
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.json();
      })
      .then(function (data) {
        var replaced = apply(data);
        DL4PY.polls += 1;
        more = replaced || data.metrics.some(function (m) { return m.more; });
        setStatus("live: updated " + new Date().toLocaleTimeString() + " (every " + options.every / 1000 + " s)");
      })
      .catch(function (error) { setStatus("cannot reach dl4py ui (" + error.message + "); retrying"); })
      .then(function () { setTimeout(function () { poll(options); }, more ? 0 : options.every); });
  }

  DL4PY.start = function (options) {
    build();
    window.addEventListener("resize", shadeTables);
    document.querySelectorAll(".scroll").forEach(function (box) { box.addEventListener("scroll", shadeTables); });
    document.getElementById("run-select").addEventListener("change", function (event) {
      select(Number(event.target.value));
    });
    if (options.data) {
      apply(options.data);
      DL4PY.polls = 1;
      setStatus(options.data.generated ? "report written " + options.data.generated : "");
    } else {
      poll({poll: options.poll || "api/poll", every: options.every || 2000});
    }
  };

  // -- the page's skeleton -------------------------------------------------------------

  function build() {
    var overview = document.getElementById("overview-charts");
    var details = document.getElementById("run-charts");
    CHARTS.forEach(function (spec) {
      (spec.section === "run" ? details : overview).appendChild(card(spec.id, spec.title, spec.help));
    });
    var confusion = card("confusion", "Confusion matrix (rows: actual class, columns: predicted)",
                         "Off the diagonal: which classes the model mixes up. Colour: share of the row.", true);
    details.appendChild(confusion);
    details.appendChild(card("classes", "Precision and recall per class (test set)",
                             "A class well below the others needs more (or cleaner) examples."));
  }

  function card(id, title, help, heat) {
    var box = el("section", {className: "card", id: "card-" + id, hidden: true}, [
      el("h3", {textContent: title}), el("p", {className: "help", textContent: help || ""})
    ]);
    box.appendChild(heat ? el("div", {className: "heatmap"}) : el("div", {className: "plot"}, [el("canvas", {})]));
    return box;
  }

  // -- small helpers -------------------------------------------------------------------

  function el(tag, props, children) {
    var node = document.createElement(tag);
    Object.keys(props || {}).forEach(function (k) { node[k] = props[k]; });
    (children || []).forEach(function (c) { node.appendChild(c); });
    return node;
  }

  function text(value) { return document.createTextNode(value === null || value === undefined ? "" : String(value)); }

  function swatch(index, label) {
    var span = el("span", {className: "run-name"}, [el("span", {className: "swatch"}), text(label)]);
    span.firstChild.style.background = COLORS[index % COLORS.length];
    return span;
  }

  function runLabel(run) { return run.info.label ? run.info.label : run.info.name; }

  function runIndex(name) {
    for (var i = 0; i < state.runs.length; i++) if (state.runs[i].info.name === name) return i;
    return -1;
  }

  function setStatus(message) { document.getElementById("status").textContent = message; }

  function isNumber(v) { return typeof v === "number" && isFinite(v); }

  function count(n) { return n.toLocaleString("en-US"); }

  function first(a, b) { return isNumber(a) ? a : b; }

  function fmt(v, digits) {
    if (v === null || v === undefined) return "";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return String(v);
    if (digits !== undefined) return v.toFixed(digits);
    var size = Math.abs(v);
    if (size >= 1e7 || size < 1e-3) return v.toExponential(3);
    return size >= 100 ? v.toFixed(1) : v.toFixed(4);
  }

  // Sort with the empty cells last in either direction.
  function compare(a, b, sign) {
    var emptyA = a === null || a === undefined || a === "", emptyB = b === null || b === undefined || b === "";
    if (emptyA || emptyB) return emptyA === emptyB ? 0 : (emptyA ? 1 : -1);
    if (typeof a === "number" && typeof b === "number") return sign * (a - b);
    return sign * String(a).localeCompare(String(b), undefined, {numeric: true});
  }
})();
