// Shoal dashboard: sign in with a token (kept in sessionStorage), list jobs, follow one job.
const api = (path, opts = {}) =>
  fetch(`/api/v1${path}`, {
    ...opts,
    headers: { Authorization: `Bearer ${sessionStorage.getItem("shoal-token")}` },
  }).then(async (r) => {
    if (r.status === 401) { signOut(); throw new Error("unauthorized"); }
    if (!r.ok) throw new Error((await r.json()).detail);
    return r.json();
  });

const $ = (id) => document.getElementById(id);
let selected = null;

function signOut() {
  sessionStorage.removeItem("shoal-token");
  $("signin").hidden = false; $("jobs").hidden = true; $("job").hidden = true;
}

function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }

async function refreshJobs() {
  const page = await api("/jobs?limit=200");
  const rows = page.items.map((job) => {
    const tr = document.createElement("tr");
    tr.tabIndex = 0;
    tr.append(cell(job.name), cell(job.owner), cell(job.state), cell(`${job.step}/${job.steps}`),
      cell(job.last_loss == null ? "" : job.last_loss.toFixed(4)), cell(job.devices.length),
      cell(new Date(job.created_at).toLocaleString()));
    tr.children[2].className = `state-${job.state}`;
    tr.onclick = tr.onkeydown = (e) => { if (!e.key || e.key === "Enter") selectJob(job.id); };
    return tr;
  });
  $("job-rows").replaceChildren(...rows);
}

function drawLoss(points) {
  const svg = $("loss");
  if (!points.length) { svg.replaceChildren(); return; }
  const xs = points.map((p) => p.step), ys = points.map((p) => p.loss);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs) || 1];
  const [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const sx = (x) => 10 + ((x - x0) / (x1 - x0 || 1)) * 580;
  const sy = (y) => 190 - ((y - y0) / (y1 - y0 || 1)) * 180;
  const path = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  path.setAttribute("points", points.map((p) => `${sx(p.step)},${sy(p.loss)}`).join(" "));
  path.setAttribute("fill", "none"); path.setAttribute("stroke", "#0b3d5c");
  svg.replaceChildren(path);
}

async function refreshJob() {
  if (!selected) return;
  const [job, metrics, events] = await Promise.all([
    api(`/jobs/${selected}`), api(`/jobs/${selected}/metrics`), api(`/jobs/${selected}/events`),
  ]);
  $("job").hidden = false;
  $("job-title").textContent = `${job.name} (${job.id.slice(0, 8)})`;
  $("job-summary").textContent =
    `${job.state} · step ${job.step}/${job.steps}` + (job.error ? ` · ${job.error}` : "");
  $("cancel").hidden = ["SUCCEEDED", "FAILED", "CANCELLED"].includes(job.state);
  drawLoss(metrics.items);
  $("partition").replaceChildren(...job.partition.map((s) => {
    const li = document.createElement("li");
    li.textContent = `stage ${s.stage}: blocks ${s.blocks[0]}–${s.blocks[1] - 1} on ${s.device_id}`;
    return li;
  }));
  $("events").replaceChildren(...events.items.map((e) => {
    const li = document.createElement("li");
    li.textContent = `${new Date(e.time).toLocaleTimeString()} ${e.kind}: ${e.message}`;
    return li;
  }));
}

function selectJob(id) { selected = id; refreshJob(); }

$("cancel").onclick = () => api(`/jobs/${selected}/cancel`, { method: "POST" }).then(refreshJob);
$("signin").onsubmit = async (e) => {
  e.preventDefault();
  sessionStorage.setItem("shoal-token", $("token").value.trim());
  try { await refreshJobs(); start(); } catch (err) { $("signin-error").textContent = err.message; }
};

function start() {
  $("signin").hidden = true; $("jobs").hidden = false;
  setInterval(() => refreshJobs().catch(() => {}), 3000);
  setInterval(() => refreshJob().catch(() => {}), 2000);
}

if (sessionStorage.getItem("shoal-token")) refreshJobs().then(start).catch(signOut);
else signOut();
