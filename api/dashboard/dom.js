// Small DOM and formatting helpers shared by every page.

/** Children to append: nested lists flattened, absent ones (null, undefined, false) left out. */
const present = (children) =>
  children.flat().filter((c) => c !== null && c !== undefined && c !== false);

/** An element: h("td", {className: "num"}, "3.2") — strings become text, never HTML. */
export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key in el && !key.startsWith("aria") && !key.startsWith("data")) el[key] = value;
    else el.setAttribute(key, value === true ? "" : value);
  }
  el.append(...present(children));
  return el;
}

const SVG = "http://www.w3.org/2000/svg";

/** An SVG element with attributes. */
export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, value);
  el.append(...children.filter((c) => c !== null && c !== undefined));
  return el;
}

export const TERMINAL = ["SUCCEEDED", "FAILED", "CANCELLED"];

export function stateBadge(state) {
  return h("span", { className: `badge state-${state}` }, state);
}

export function fmt(value, digits = 4) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en");
  return Number(value.toPrecision(digits)).toString();
}

export function bytes(size) {
  if (size === null || size === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (size >= 1024 && i < units.length - 1) { size /= 1024; i += 1; }
  return `${size.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function age(iso, now = Date.now()) {
  const seconds = Math.max(0, (now - Date.parse(iso)) / 1000);
  if (seconds < 60) return `${Math.floor(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h`;
  return `${Math.floor(seconds / 86400)} d`;
}

export function time(iso) {
  return new Date(iso).toLocaleTimeString("en-GB");
}

export function short(id) {
  return id.slice(0, 8);
}

/** Run ``fn`` at most once per ``ms``, the last call winning (for bursts of stream messages). */
export function debounce(fn, ms) {
  let timer = null;
  const wrapped = () => {
    clearTimeout(timer);
    timer = setTimeout(fn, ms);
  };
  wrapped.cancel = () => clearTimeout(timer);
  return wrapped;
}

/** A link to a page of the dashboard. */
export function link(hash, text) {
  return h("a", { href: `#/${hash}` }, text);
}

/** Run ``fn`` once before the next paint however often this is called meanwhile. */
export function nextFrame(fn) {
  let pending = false;
  return () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; fn(); });
  };
}

/** Run the async ``fn`` one call at a time; calls made while it runs fold into one more. */
export function serial(fn) {
  let running = null, again = false;
  const run = async () => {
    if (running) { again = true; return running; }
    running = (async () => {
      do { again = false; await fn(); } while (again);
    })().finally(() => { running = null; });
    return running;
  };
  return run;
}

/** Replace ``el``'s children, skipping the absent ones (null, undefined, false). */
export function fill(el, ...children) {
  el.replaceChildren(...present(children));
}
