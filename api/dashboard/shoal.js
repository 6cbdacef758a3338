// Shoal dashboard: sign in with a token (kept in sessionStorage, never in a URL), then pages
// by hash route, all fed by one live stream (GET /api/v1/stream) per tab.
import { Unauthorized, follow, token } from "./api.js";
import * as devices from "./devices.js";
import { h } from "./dom.js";
import * as job from "./job.js";
import * as jobs from "./jobs.js";
import * as sweeps from "./sweeps.js";

const ROUTES = [
  [/^jobs\/([\w-]+)$/, job.mount, "jobs"],
  [/^jobs$/, jobs.mount, "jobs"],
  [/^devices$/, devices.mount, "devices"],
  [/^sweeps\/([\w-]+)$/, sweeps.mountSweep, "sweeps"],
  [/^sweeps$/, sweeps.mountList, "sweeps"],
];

const $ = (id) => document.getElementById(id);
let page = null, stream = null;

function signOut(reason = "") {
  token.clear();
  if (stream) stream.stop();
  stream = null;
  if (page) page.unmount();
  page = null;
  $("app").hidden = $("bar").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = reason;
  $("token").focus();
}

function failed(err) {
  if (err instanceof Unauthorized) signOut("That token was refused: check it and sign in again.");
  else $("problem").textContent = `Could not load this page: ${err.message}`;
}

async function load() {
  if (!page) return;
  $("problem").textContent = "";
  try { await page.reload(); } catch (err) { failed(err); }
}

/** Show the page the hash names; its data loads once the stream is open (``start``). */
function route() {
  const path = location.hash.replace(/^#\/?/, "") || "jobs";
  const [pattern, mount, section] = ROUTES.find(([re]) => re.test(path)) || ROUTES[1];
  if (page) page.unmount();
  const view = h("div", { className: "view" });
  $("view").replaceChildren(view);
  page = mount(view, path.match(pattern).slice(1));
  for (const a of document.querySelectorAll("nav a")) {
    if (a.dataset.section === section) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
}

function start() {
  $("signin").hidden = true;
  $("app").hidden = $("bar").hidden = false;
  route();
  stream = follow({
    // Loaded once the stream is open, so that no change falls between the two; again on
    // each reconnection (what changed while it was down).
    onOpen: load,
    onMessage: (message) => { if (page) page.onMessage(message); },
    onState: (state) => {
      $("live").textContent = state;
      $("live").className = `live ${state}`;
      if (state === "reconnecting") load(); // the latest state, even without a stream
    },
    onUnauthorized: () => signOut("That token was refused: check it and sign in again."),
  });
}

$("signin").onsubmit = (event) => {
  event.preventDefault();
  token.set($("token").value.trim());
  $("token").value = "";
  start();
};
$("signout").onclick = () => signOut();
window.addEventListener("hashchange", () => {
  if (!stream) return;
  route();
  load();
});

if (token.get()) start();
else signOut();
