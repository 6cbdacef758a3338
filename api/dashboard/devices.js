// The device pool by node: kind, spot or on-demand, memory held of the budget, measured
// speed, the job there; lost and draining devices marked.
import { api } from "./api.js";
import { bytes, debounce, fmt, h, link, short } from "./dom.js";

const REFRESH_MS = 15000; // devices are lost or come back without a job event

function status(device) {
  if (device.state !== "alive") return h("span", { className: "badge lost" }, device.state.toUpperCase());
  if (device.draining) {
    return h("span", { className: "badge draining", title: device.drain_reason || "" }, "DRAINING");
  }
  return h("span", { className: "badge alive" }, "alive");
}

function memory(device) {
  const budget = device.memory_mb * 2 ** 20, used = device.memory_used_bytes;
  return h("div", {},
    h("meter", { min: 0, max: budget, value: used || 0, "aria-label": `memory of ${device.id}` }),
    h("span", { className: "sub" }, ` ${used === null ? "–" : bytes(used)} / ${bytes(budget)}`));
}

function job(device) {
  if (!device.job_id) return "idle";
  if (device.job_id.startsWith("(")) return device.job_id; // another user's
  return link(`jobs/${device.job_id}`, short(device.job_id));
}

function nodeTable(nodeId, devices) {
  const spot = devices.some((d) => d.spot);
  const kinds = [...new Set(devices.map((d) => d.kind))].join(", ");
  return h("section", { className: "node", "aria-label": `node ${nodeId}` },
    h("h3", {}, `Node ${short(nodeId)}`, h("span", { className: "sub" }, ` ${kinds} · ${spot ? "spot" : "on-demand"}`)),
    h("table", {},
      h("thead", {}, h("tr", {}, ["Device", "Kind", "Status", "Spot", "Memory (held / budget)",
        "Speed", "Job"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, devices.map((d) => h("tr", {
        className: d.state !== "alive" ? "lost" : d.draining ? "draining" : "", "data-device": d.id },
      h("td", {}, h("code", {}, d.id)), h("td", {}, d.kind),
      h("td", {}, status(d), d.draining && d.drain_reason
        ? h("div", { className: "sub" }, d.drain_reason) : ""),
      h("td", {}, d.spot ? "spot" : "–"), h("td", {}, memory(d)),
      h("td", { className: "num" }, d.speed_gflops ? `${fmt(d.speed_gflops, 3)} GFLOP/s` : "–"),
      h("td", {}, job(d)))))));
}

export function mount(root) {
  const body = h("div", {});
  const summary = h("p", { className: "count" });
  root.append(h("h2", {}, "Devices"), summary, body);

  async function reload() {
    const { items } = await api("/devices");
    const nodes = new Map();
    for (const d of items) nodes.set(d.node_id, [...(nodes.get(d.node_id) || []), d]);
    const alive = items.filter((d) => d.state === "alive");
    summary.textContent = `${items.length} devices on ${nodes.size} nodes: ${alive.length} alive`
      + `, ${alive.filter((d) => d.job_id).length} busy, ${alive.filter((d) => d.draining).length}`
      + ` draining, ${items.length - alive.length} lost`;
    body.replaceChildren(...[...nodes].map(([node, devices]) => nodeTable(node, devices)));
  }
  const soon = debounce(() => reload().catch(() => {}), 1000);
  const timer = setInterval(soon, REFRESH_MS);
  return {
    reload,
    onMessage({ kind, data }) {
      if (kind === "event" && ["placement", "relayout", "recovered", "device_lost", "state",
        "device_speed", "repartition"].includes(data.kind)) soon();
    },
    unmount() { clearInterval(timer); soon.cancel(); },
  };
}
