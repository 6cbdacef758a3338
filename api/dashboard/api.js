// The REST API and the live stream, with the signed-in token (sessionStorage, never a URL).
const TOKEN = "shoal-token";

export class Unauthorized extends Error {}

export const token = {
  get: () => sessionStorage.getItem(TOKEN),
  set: (value) => sessionStorage.setItem(TOKEN, value),
  clear: () => sessionStorage.removeItem(TOKEN),
};

function headers() {
  return { Authorization: `Bearer ${token.get()}` };
}

/** GET (or ``opts.method``) ``/api/v1${path}``; throws Unauthorized on 401, Error(detail) else. */
export async function api(path, opts = {}) {
  const response = await fetch(`/api/v1${path}`, { ...opts, headers: headers() });
  if (response.status === 401) throw new Unauthorized("the token was refused");
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.detail || `${response.status} ${response.statusText}`);
  return body;
}

/** Every item of a paged list (jobs, sweeps), page by page as the server caps them. */
export async function all(path, cap = 5000) {
  const items = [];
  for (let offset = 0; offset < cap; ) {
    const sep = path.includes("?") ? "&" : "?";
    const page = await api(`${path}${sep}limit=500&offset=${offset}`);
    items.push(...page.items);
    offset += page.limit;
    if (offset >= page.total || !page.items.length) break;
  }
  return items;
}

function parse(block) {
  let kind = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue; // a comment: connected, keep-alive
    if (line.startsWith("event:")) kind = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
  }
  return data.length ? { kind, data: JSON.parse(data.join("\n")) } : null;
}

/**
 * Follow ``GET /api/v1/stream`` (server-sent events read with fetch: EventSource cannot
 * send the bearer header). ``onOpen`` runs on each (re)connection — load the current state
 * then, the stream carries what changes after — ``onMessage({kind, data})`` per message,
 * ``onState(text)`` with the connection's state. Reconnects with back-off; ``stop()`` ends it.
 */
export function follow({ onOpen, onMessage, onState, onUnauthorized }) {
  const abort = new AbortController();
  (async () => {
    let wait = 500;
    while (!abort.signal.aborted) {
      try {
        const response = await fetch("/api/v1/stream", { headers: headers(), signal: abort.signal });
        if (response.status === 401) { onUnauthorized(); return; }
        if (!response.ok) throw new Error(`${response.status}`);
        onState("live");
        wait = 500;
        await onOpen();
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            const message = parse(buffer.slice(0, end));
            buffer = buffer.slice(end + 2);
            if (message) onMessage(message);
          }
        }
      } catch (err) {
        if (abort.signal.aborted) return;
        if (err instanceof Unauthorized) { onUnauthorized(); return; }
      }
      onState("reconnecting");
      await new Promise((resolve) => setTimeout(resolve, wait));
      wait = Math.min(wait * 2, 15000);
    }
  })();
  return { stop: () => abort.abort() };
}
