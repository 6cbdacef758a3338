// One job: live loss and throughput, its pipeline and schedule, its events; cancel.
import { api } from "./api.js";
import { lineChart } from "./charts.js";
import { TERMINAL, age, fill, fmt, h, link, serial, short, stateBadge, time } from "./dom.js";
import { pipelinePicture, scheduleGrid } from "./pipeline.js";

const LAYOUT_EVENTS = ["placement", "repartition", "relayout", "recovered", "resumed", "device_speed"];

function percent(x) {
  return x === undefined || x === null ? "?" : `${(x * 100).toFixed(0)}%`;
}

/** What an event's data adds to its message: gains, steps replayed, sizes. */
function detail(event) {
  const d = event.data || {};
  if (event.kind === "repartition") return `predicted gain ${percent(d.predicted_gain)}`;
  if (event.kind === "repartition_result") {
    return `measured ${percent(d.measured_gain)} vs predicted ${percent(d.predicted_gain)}`;
  }
  if (event.kind === "copies") {
    const steps = d.interval === 1 ? "step" : `${d.interval} steps`;
    return `every ${steps}, ${percent(d.overhead)} of the training time`;
  }
  if ("steps_replayed" in d) {
    const most = "copy_interval" in d ? ` (copies every ${d.copy_interval})` : "";
    return `${d.steps_replayed} steps replayed${most}`;
  }
  return "";
}

function eventItem(event) {
  const extra = detail(event);
  return h("li", { className: `event kind-${event.kind}`, "data-event": event.id },
    h("time", { dateTime: event.time }, time(event.time)),
    h("span", { className: "badge" }, event.kind.replace("_", " ")),
    h("span", {}, event.message),
    extra ? h("span", { className: "sub" }, ` — ${extra}`) : null);
}

export function mount(root, [jobId]) {
  let job = null, lastStep = -1, armed = false;
  const shown = new Set();
  const points = [];
  const head = h("div", { className: "job-head" });
  const charts = h("div", { className: "charts" });
  const pipeline = h("section", { "aria-labelledby": "pipeline-title" });
  const schedule = h("section", { "aria-labelledby": "schedule-title" });
  const events = h("ol", { className: "timeline", id: "events" });
  const cancel = h("button", { type: "button", id: "cancel", className: "danger" }, "Cancel job");
  root.append(h("p", {}, link("jobs", "← Jobs")), head, charts,
    h("h3", { id: "pipeline-title" }, "Pipeline"), pipeline,
    h("h3", { id: "schedule-title" }, "Schedule"), schedule,
    h("h3", {}, "Events"), events);

  cancel.onclick = async () => {
    if (!armed) {
      armed = true;
      cancel.textContent = "Confirm: cancel this job";
      setTimeout(() => { armed = false; cancel.textContent = "Cancel job"; }, 5000);
      return;
    }
    cancel.disabled = true;
    job = await api(`/jobs/${jobId}/cancel`, { method: "POST" });
    drawHead();
  };

  function drawHead() {
    const live = !TERMINAL.includes(job.state) && !job.cancel_requested;
    const done = job.steps ? job.step / job.steps : 0;
    fill(
      head,
      h("h2", {}, job.name, h("span", { className: "id" }, short(job.id))),
      h("p", { className: "summary", id: "job-summary" }, stateBadge(job.state),
        ` step ${job.step}/${job.steps} · loss ${fmt(job.last_loss)} · ${fmt(job.samples_per_s, 3)} samples/s`
        + (job.mfu == null ? "" : ` · MFU ${Number((job.mfu * 100).toPrecision(3))}%`)
        + ` · ${job.devices.length} devices · ${job.owner} · started ${age(job.created_at)} ago`
        + (job.cancel_requested && !TERMINAL.includes(job.state) ? " · cancel requested" : "")),
      h("progress", { max: 1, value: done, "aria-label": "steps done" }),
      job.error ? h("p", { className: "error", role: "alert" }, job.error) : null,
      live ? cancel : null);
  }

  function drawCharts() {
    charts.replaceChildren(
      lineChart([{ name: "loss", points: points.map((m) => ({ x: m.step, y: m.loss })) }],
        { xLabel: "step", yLabel: "loss", label: "Loss per step" }),
      lineChart([{ name: "samples/s", points: points.map((m) => ({ x: m.step, y: m.samples_per_s })),
        color: "#15803d" }], { xLabel: "step", yLabel: "samples/s", label: "Throughput per step" }),
      ...(points.some((m) => m.mfu != null)
        ? [lineChart([{ name: "MFU", points: points.filter((m) => m.mfu != null)
          .map((m) => ({ x: m.step, y: m.mfu })), color: "#7c3aed" }],
        { xLabel: "step", yLabel: "MFU", label: "Model FLOPs utilization per step" })]
        : []));
    charts.firstChild.id = "loss-chart";
  }

  const fetchMetrics = serial(async () => {
    for (;;) {
      const page = await api(`/jobs/${jobId}/metrics?since_step=${lastStep}`);
      if (!page.items.length) break;
      points.push(...page.items);
      lastStep = page.items[page.items.length - 1].step;
    }
    drawCharts();
  });

  const fetchLayout = serial(async () => {
    const [fresh, devices] = await Promise.all([api(`/jobs/${jobId}`), api("/devices")]);
    job = fresh;
    drawHead();
    pipeline.replaceChildren(pipelinePicture(job, new Map(devices.items.map((d) => [d.id, d]))));
    try {
      schedule.replaceChildren(scheduleGrid(await api(`/jobs/${jobId}/schedule`)));
    } catch (err) {
      schedule.replaceChildren(h("p", { className: "empty" }, err.message));
    }
  });

  /** Each event once, in id order: the stream may deliver newer ones while the list loads. */
  function addEvents(items) {
    for (const event of items) {
      if (shown.has(event.id)) continue;
      shown.add(event.id);
      const last = events.lastElementChild;
      const later = !last || Number(last.dataset.event) < event.id ? null
        : [...events.children].find((li) => Number(li.dataset.event) > event.id);
      events.insertBefore(eventItem(event), later || null);
    }
  }

  return {
    async reload() {
      points.length = 0; lastStep = -1;
      shown.clear();
      events.replaceChildren();
      await fetchLayout();
      addEvents((await api(`/jobs/${jobId}/events`)).items);
      await fetchMetrics();
    },
    onMessage({ kind, data }) {
      if (kind === "job" && data.id === jobId && job) { // (before the first load: it reads it)
        const stepped = data.step !== job.step;
        job = { ...job, ...data };
        drawHead();
        if (stepped) fetchMetrics();
        fetchLayout(); // stage times of the latest step
      } else if (kind === "event" && data.job_id === jobId) {
        addEvents([data]);
        if (LAYOUT_EVENTS.includes(data.kind)) fetchLayout();
      }
    },
    unmount() {},
  };
}
