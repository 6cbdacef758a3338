// The jobs page: every job the viewer may see, filtered, kept live from the stream.
import { all } from "./api.js";
import { age, fmt, h, link, nextFrame, short, stateBadge } from "./dom.js";

const STATES = ["QUEUED", "RUNNING", "RECOVERING", "SUCCEEDED", "FAILED", "CANCELLED"];

function row(job, now) {
  return h("tr", { "data-job": job.id },
    h("td", {}, link(`jobs/${job.id}`, job.name), h("span", { className: "id" }, short(job.id))),
    h("td", {}, job.owner),
    h("td", {}, stateBadge(job.state)),
    h("td", { className: "num" }, `${job.step}/${job.steps}`),
    h("td", { className: "num" }, fmt(job.last_loss)),
    h("td", { className: "num" }, fmt(job.samples_per_s, 3)),
    h("td", { className: "num" }, String(job.devices.length)),
    h("td", { className: "num", title: job.created_at }, age(job.created_at, now)));
}

export function mount(root) {
  const jobs = new Map();
  const state = h("select", { id: "filter-state" },
    h("option", { value: "" }, "any state"), STATES.map((s) => h("option", { value: s }, s)));
  const text = h("input", { id: "filter-text", type: "search", placeholder: "name or owner" });
  const rows = h("tbody");
  const count = h("p", { className: "count", "aria-live": "polite" });
  root.append(
    h("h2", {}, "Jobs"),
    h("form", { className: "filters", role: "search", onsubmit: (e) => e.preventDefault() },
      h("label", { htmlFor: "filter-state" }, "State"), state,
      h("label", { htmlFor: "filter-text" }, "Search"), text),
    count,
    h("table", { id: "jobs-table" },
      h("caption", { className: "sr-only" }, "Jobs, newest first"),
      h("thead", {}, h("tr", {}, ["Name", "Owner", "State", "Step", "Loss", "Samples/s",
        "Devices", "Age"].map((c) => h("th", { scope: "col" }, c)))),
      rows));

  function render() {
    const wanted = state.value, needle = text.value.trim().toLowerCase(), now = Date.now();
    const shown = [...jobs.values()]
      .filter((j) => !wanted || j.state === wanted)
      .filter((j) => !needle || j.name.toLowerCase().includes(needle)
        || j.owner.toLowerCase().includes(needle))
      .sort((a, b) => b.created_at.localeCompare(a.created_at));
    rows.replaceChildren(...shown.map((j) => row(j, now)));
    count.textContent = `${shown.length} of ${jobs.size} jobs`;
  }
  const later = nextFrame(render);
  state.onchange = text.oninput = render;
  const ticker = setInterval(render, 30000); // ages

  return {
    async reload() {
      jobs.clear();
      for (const job of await all("/jobs")) jobs.set(job.id, job);
      render();
    },
    onMessage({ kind, data }) {
      if (kind !== "job") return;
      jobs.set(data.id, { ...jobs.get(data.id), ...data });
      later();
    },
    unmount() { clearInterval(ticker); },
  };
}
