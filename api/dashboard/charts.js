// Line charts and scatter plots drawn as SVG, with axes, ticks and accessible labels.
import { fmt, h, s } from "./dom.js";

const W = 640, H = 240, M = { left: 56, right: 12, top: 12, bottom: 36 };
export const PALETTE = ["#0b5cad", "#c2410c", "#15803d", "#7e22ce", "#b91c1c", "#0e7490",
  "#a16207", "#be185d", "#4d7c0f", "#1e3a8a"];

function ticks(lo, hi, count = 5) {
  if (lo === hi) return [lo];
  const raw = (hi - lo) / count, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((k) => k * mag).find((k) => raw <= k);
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(t);
  return out;
}

function frame(xs, ys, { xLabel, yLabel, label, xTicks }) {
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const pad = (y1 - y0) * 0.05 || Math.abs(y0) * 0.05 || 1;
  const [lo, hi] = [y0 - pad, y1 + pad];
  const sx = (x) => M.left + ((x - x0) / (x1 - x0 || 1)) * (W - M.left - M.right);
  const sy = (y) => H - M.bottom - ((y - lo) / (hi - lo)) * (H - M.top - M.bottom);
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label });
  const axis = s("g", { class: "axis" });
  for (const t of ticks(lo, hi)) {
    axis.append(s("line", { x1: M.left, x2: W - M.right, y1: sy(t), y2: sy(t), class: "grid" }),
      s("text", { x: M.left - 6, y: sy(t) + 4, "text-anchor": "end" }, fmt(t, 3)));
  }
  for (const t of xTicks || ticks(x0, x1, 6)) {
    axis.append(s("text", { x: sx(t), y: H - M.bottom + 16, "text-anchor": "middle" },
      xTicks ? xTicks.label(t) : fmt(t, 4)));
  }
  axis.append(
    s("text", { x: (M.left + W - M.right) / 2, y: H - 4, "text-anchor": "middle" }, xLabel),
    s("text", { x: 12, y: H / 2, transform: `rotate(-90 12 ${H / 2})`, "text-anchor": "middle" },
      yLabel),
    s("line", { x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom, class: "frame" }),
    s("line", { x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, class: "frame" }));
  svg.append(axis);
  return { svg, sx, sy };
}

/** One or more series ``{name, points: [{x, y}], color?, strong?}`` on shared axes. */
export function lineChart(series, { xLabel, yLabel, label }) {
  const shown = series.filter((line) => line.points.length);
  const figure = h("figure", { className: "chart" });
  if (!shown.length) {
    figure.append(h("p", { className: "empty" }, `${label}: no data yet`));
    return figure;
  }
  const xs = shown.flatMap((l) => l.points.map((p) => p.x));
  const ys = shown.flatMap((l) => l.points.map((p) => p.y)).filter(Number.isFinite);
  const { svg, sx, sy } = frame(xs, ys.length ? ys : [0], { xLabel, yLabel, label });
  shown.forEach((line, i) => {
    const color = line.color || PALETTE[i % PALETTE.length];
    const points = line.points.filter((p) => Number.isFinite(p.y));
    const path = points.map((p) => `${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join(" ");
    svg.append(s("polyline", { points: path, fill: "none", stroke: color,
      "stroke-width": line.strong ? 3 : 1.6, class: "series", "data-name": line.name }));
    if (points.length === 1) {
      svg.append(s("circle", { cx: sx(points[0].x), cy: sy(points[0].y), r: 3, fill: color }));
    }
  });
  figure.append(svg, h("figcaption", {}, label));
  if (shown.length > 1) {
    figure.append(h("ul", { className: "legend" }, shown.map((line, i) => h("li", {},
      h("span", { className: "swatch", style: `background:${line.color || PALETTE[i % PALETTE.length]}` }),
      line.name))));
  }
  return figure;
}

/** Points ``{x, y, label, color?}``; ``categories`` (strings) place x at their index,
 * ``log`` puts x on a log scale (log-uniform hyperparameters such as a learning rate). */
export function scatter(points, { xLabel, yLabel, label, categories, log }) {
  const figure = h("figure", { className: "chart" });
  const shown = points.filter((p) => Number.isFinite(p.y));
  if (!shown.length) {
    figure.append(h("p", { className: "empty" }, `${label}: no data yet`));
    return figure;
  }
  let xOf = (p) => Number(p.x), xTicks = null;
  if (categories) {
    xOf = (p) => categories.indexOf(String(p.x));
    xTicks = Object.assign(categories.map((_, i) => i), { label: (i) => categories[i] });
  } else if (log) {
    xOf = (p) => Math.log10(Number(p.x));
    const logs = shown.map(xOf);
    const marks = ticks(Math.min(...logs), Math.max(...logs), 4);
    xTicks = Object.assign(marks, { label: (t) => fmt(10 ** t, 2) });
  }
  const xs = categories ? [-0.5, categories.length - 0.5] : shown.map(xOf);
  const { svg, sx, sy } = frame(xs, shown.map((p) => p.y), { xLabel, yLabel, label, xTicks });
  for (const p of shown) {
    svg.append(s("circle", { cx: sx(xOf(p)), cy: sy(p.y), r: 5, fill: p.color || PALETTE[0],
      class: "point" }, s("title", {}, p.label)));
  }
  figure.append(svg, h("figcaption", {}, label));
  return figure;
}
