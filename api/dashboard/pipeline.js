// The pipeline as a picture (blocks per stage per device, each stage's step time split into
// compute, idle, transfer, all-reduce and in-memory copies) and the schedule grid the
// stages run each mini-batch.
import { fmt, h } from "./dom.js";

const PARTS = [
  ["compute_s", "compute"],
  ["idle_s", "idle"],
  ["transfer_s", "transfer"],
  ["allreduce_s", "all-reduce"],
  ["copy_s", "copy"],
];

function blocksTrack(blocks, total) {
  const [start, stop] = blocks;
  return h("div", { className: "track", role: "img",
    "aria-label": `blocks ${start} to ${stop - 1} of ${total}` },
  h("div", { className: "held", style: `margin-left:${(start / total) * 100}%;width:${((stop - start) / total) * 100}%` },
    stop - start === 1 ? `block ${start}` : `blocks ${start}–${stop - 1}`));
}

function timeBar(timing, longest) {
  if (!timing) return h("span", { className: "empty" }, "no step timed yet");
  return h("div", { className: "bar", role: "img", "aria-label": PARTS.map(([key, name]) =>
    `${name} ${fmt(timing[key] || 0, 3)} s`).join(", ") },
  PARTS.filter(([key]) => timing[key] > 0).map(([key, name]) => h("div", {
    className: `part ${name.replace("-", "")}`, title: `${name}: ${fmt(timing[key], 3)} s`,
    style: `width:${(timing[key] / longest) * 100}%` })));
}

/** ``job`` (partition, stage_times, num_blocks) and the devices by id (kind, speed). */
export function pipelinePicture(job, devices) {
  if (!job.partition.length) return h("p", { className: "empty" }, "not placed yet");
  const timings = new Map((job.stage_times || []).map((t) => [`${t.stage}/${t.replica}`, t]));
  const total = (t) => PARTS.reduce((sum, [key]) => sum + (t[key] || 0), 0);
  const longest = Math.max(1e-9, ...[...timings.values()].map(total));
  const slowest = [...timings.values()].reduce((a, b) => (!a || b.compute_s > a.compute_s ? b : a), null);
  const rows = [...job.partition]
    .sort((a, b) => a.replica - b.replica || a.stage - b.stage)
    .map((stage) => {
      const timing = timings.get(`${stage.stage}/${stage.replica}`);
      const device = devices.get(stage.device_id);
      const slow = timings.size > 1 && timing && timing === slowest;
      return h("tr", { className: slow ? "slowest" : "", "data-stage": stage.stage },
        h("th", { scope: "row" }, `stage ${stage.stage}`, stage.replica ? ` · replica ${stage.replica}` : ""),
        h("td", {}, h("code", {}, stage.device_id),
          (stage.tensor_devices || []).length
            ? h("div", { className: "sub tensor" }, `split with ${stage.tensor_devices.join(", ")}`) : null,
          h("div", { className: "sub" }, device ? `${device.kind}${device.spot ? " · spot" : ""} · ${fmt(device.speed_gflops, 3)} GFLOP/s` : ""),
          slow ? h("span", { className: "badge warn" }, "slowest stage") : null),
        h("td", {}, blocksTrack(stage.blocks, job.num_blocks)),
        h("td", {}, timeBar(timing, longest)),
        h("td", { className: "num" }, timing ? PARTS.map(([key, name]) =>
          timing[key] ? h("div", {}, `${name} ${fmt(timing[key], 3)} s`) : null) : "–"));
    });
  return h("div", {},
    h("table", { className: "pipeline", id: "pipeline" },
      h("caption", {}, "Each stage's blocks and device, and its time in the latest step"),
      h("thead", {}, h("tr", {}, ["Stage", "Device", `Blocks (of ${job.num_blocks})`,
        "Latest step", "Seconds"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, rows)),
    h("ul", { className: "legend" }, PARTS.map(([, name]) => h("li", {},
      h("span", { className: `swatch part ${name.replace("-", "")}` }), name))));
}

/** The schedule grid: one row per stage, one cell per time slot, the bubble left blank. */
export function scheduleGrid(schedule) {
  const name = schedule.name === "1f1b" ? "1F1B" : "GPipe";
  return h("table", { className: "schedule", id: "schedule" },
    h("caption", {}, `${name}, ${schedule.stages} stages × ${schedule.micro_batches} micro-batches`
      + ` per replica: bubble ${(schedule.bubble * 100).toFixed(0)}% of the stages' time`),
    h("tbody", {}, schedule.grid.map((cells, stage) => h("tr", {},
      h("th", { scope: "row" }, `stage ${stage}`),
      cells.map((cell) => h("td", { className: cell ? `op-${cell[0]}` : "idle",
        title: cell ? `${cell[0] === "F" ? "forward" : "backward"} of micro-batch ${cell.slice(1)}` : "idle" },
      cell || ""))))));
}
