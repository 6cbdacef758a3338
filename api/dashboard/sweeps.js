// Sweeps: the list, and one sweep's trials — objective curves on one chart, the best trial,
// each hyperparameter against the objective.
import { all, api } from "./api.js";
import { PALETTE, lineChart, scatter } from "./charts.js";
import { age, debounce, fill, fmt, h, link, short, stateBadge } from "./dom.js";

const STATE_COLORS = { SUCCEEDED: "#0b5cad", PRUNED: "#9a6700", RUNNING: "#15803d",
  FAILED: "#b91c1c", CANCELLED: "#57606a", QUEUED: "#57606a", RECOVERING: "#c2410c" };

function counts(sweep) {
  return Object.entries(sweep.trial_counts).filter(([, n]) => n)
    .map(([state, n]) => `${n} ${state.toLowerCase()}`).join(", ") || "none yet";
}

export function mountList(root) {
  const rows = h("tbody");
  root.append(h("h2", {}, "Sweeps"), h("table", { id: "sweeps-table" },
    h("thead", {}, h("tr", {}, ["Name", "Owner", "State", "Trials", "Best objective", "Age"]
      .map((c) => h("th", { scope: "col" }, c)))), rows));
  async function reload() {
    const sweeps = await all("/sweeps");
    rows.replaceChildren(...sweeps.map((sw) => h("tr", { "data-sweep": sw.id },
      h("td", {}, link(`sweeps/${sw.id}`, sw.name), h("span", { className: "id" }, short(sw.id))),
      h("td", {}, sw.owner), h("td", {}, stateBadge(sw.state)),
      h("td", {}, `${counts(sw)} (of ${sw.max_trials})`),
      h("td", { className: "num" }, sw.best ? `${fmt(sw.best.objective)} (trial ${sw.best.number})` : "–"),
      h("td", { className: "num" }, age(sw.created_at)))));
  }
  const soon = debounce(() => reload().catch(() => {}), 2000);
  return {
    reload,
    onMessage({ kind }) { if (kind === "job") soon(); }, // trials are jobs
    unmount() { soon.cancel(); },
  };
}

function show(value) {
  return typeof value === "number" ? fmt(value, 4) : String(value);
}

/** A trial's objective: its final one, or the last reported (pruned, running). */
function objectiveOf(trial) {
  if (trial.objective !== null) return trial.objective;
  const last = trial.intermediate[trial.intermediate.length - 1];
  return last ? last.value : NaN;
}

function paramView(sweep, name) {
  const space = sweep.spec.space[name] || {};
  const points = sweep.trials.map((t) => ({ x: t.params[name], y: objectiveOf(t),
    label: `trial ${t.number} (${t.state}): ${name}=${t.params[name]}, objective ${fmt(objectiveOf(t))}`,
    color: STATE_COLORS[t.state] })).filter((p) => p.x !== undefined);
  const figure = scatter(points, {
    xLabel: name, yLabel: sweep.objective.metric, label: `${name} vs ${sweep.objective.metric}`,
    categories: space.type === "categorical" ? space.choices.map(String) : null,
    log: space.type === "log_uniform",
  });
  const states = [...new Set(sweep.trials.map((t) => t.state))];
  figure.append(h("ul", { className: "legend" }, states.map((state) => h("li", {},
    h("span", { className: "swatch", style: `background:${STATE_COLORS[state]}` }),
    state.toLowerCase()))));
  return figure;
}

export function mountSweep(root, [sweepId]) {
  let sweep = null;
  const head = h("div");
  const curves = h("div", { className: "charts" });
  const params = h("div", { className: "charts" });
  const picker = h("select", { id: "param" });
  const trials = h("tbody");
  const cancel = h("button", { type: "button", className: "danger", id: "cancel-sweep" }, "Cancel sweep");
  cancel.onclick = async () => {
    cancel.disabled = true;
    await api(`/sweeps/${sweepId}/cancel`, { method: "POST" });
    reload();
  };
  root.append(h("p", {}, link("sweeps", "← Sweeps")), head,
    h("h3", {}, "Objective by step"), curves,
    h("h3", {}, "Hyperparameters vs objective"),
    h("p", {}, h("label", { htmlFor: "param" }, "Hyperparameter "), picker), params,
    h("h3", {}, "Trials"), h("table", { id: "trials-table" }, h("thead"), trials));
  picker.onchange = () => params.replaceChildren(paramView(sweep, picker.value));

  function draw() {
    const names = Object.keys(sweep.spec.space);
    const best = sweep.best ? sweep.best.number : null;
    fill(
      head,
      h("h2", {}, sweep.name, h("span", { className: "id" }, short(sweep.id))),
      h("p", { className: "summary" }, stateBadge(sweep.state),
        ` ${counts(sweep)} of ${sweep.max_trials} · ${sweep.objective.direction} ${sweep.objective.metric}`),
      sweep.best
        ? h("p", { className: "best", id: "best-trial" }, `Best: trial ${best}, objective ${fmt(sweep.best.objective)} — `,
          names.map((n) => `${n}=${show(sweep.best.params[n])}`).join(", "))
        : h("p", { className: "best" }, "No trial has finished yet."),
      sweep.error ? h("p", { className: "error", role: "alert" }, sweep.error) : null,
      ["QUEUED", "RUNNING"].includes(sweep.state) && !sweep.cancel_requested ? cancel : null);
    curves.replaceChildren(lineChart(sweep.trials.map((t, i) => ({
      name: `trial ${t.number} (${t.state.toLowerCase()})`,
      points: t.intermediate.map((p) => ({ x: p.step, y: p.value })),
      color: PALETTE[i % PALETTE.length], strong: t.number === best,
    })), { xLabel: "step", yLabel: sweep.objective.metric, label: "Objective of every trial by step" }));
    if (picker.options.length !== names.length) {
      picker.replaceChildren(...names.map((n) => h("option", { value: n }, n)));
    }
    params.replaceChildren(paramView(sweep, picker.value || names[0]));
    trials.previousSibling.replaceChildren(h("tr", {}, ["Trial", "State", ...names, "Objective", "Job"]
      .map((c) => h("th", { scope: "col" }, c))));
    trials.replaceChildren(...sweep.trials.map((t) => h("tr", {
      className: t.number === best ? "best" : "", "data-trial": t.number },
    h("td", {}, String(t.number)), h("td", {}, stateBadge(t.state)),
    names.map((n) => h("td", { className: "num" }, show(t.params[n]))),
    h("td", { className: "num" }, fmt(objectiveOf(t))),
    h("td", {}, link(`jobs/${t.job_id}`, short(t.job_id))))));
  }

  async function reload() {
    sweep = await api(`/sweeps/${sweepId}`);
    draw();
  }
  const soon = debounce(() => reload().catch(() => {}), 1000);
  return {
    reload,
    onMessage({ kind, data }) {
      const trialJob = kind === "job" ? data.id : data.job_id;
      if (sweep && sweep.trials.some((t) => t.job_id === trialJob)) soon();
      else if (kind === "event" && data.kind === "trial") soon(); // a new trial started
    },
    unmount() { soon.cancel(); },
  };
}
