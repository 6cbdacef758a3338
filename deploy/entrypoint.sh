#!/bin/sh
# shoal-entrypoint MODE: what one Shoal container runs (the image's entrypoint).
#
#   control-plane  wait for the database and the Ray head at $RAY_ADDRESS, join the Ray
#                  cluster as a node without CPUs (a Ray driver needs a raylet beside it;
#                  no work is placed there), then serve the API, dashboard and controller;
#                  the database is migrated on start.
#   healthcheck    the container's health: the control plane's /healthz, or the Ray
#                  cluster this node belongs to.
#   anything else  runs as given: `ray start --head ...`, `shoal node GROUP --address ...`,
#                  `shoal status`, ...
set -eu

ROLE_FILE=/tmp/shoal-role
WAIT_S="${SHOAL_WAIT_S:-180}"

wait_for_database() {
    [ -n "${SHOAL_DATABASE_URL:-}" ] || return 0  # SQLite under $SHOAL_HOME
    python - "$WAIT_S" <<'PY'
import sys, time
import sqlalchemy as sa
from shoal.service.settings import Settings

url = Settings().resolved_database_url
shown = sa.engine.make_url(url).render_as_string(hide_password=True)
deadline = time.monotonic() + float(sys.argv[1])
engine = sa.create_engine(url)
while True:
    try:
        with engine.connect():
            break
    except sa.exc.OperationalError as exc:
        if time.monotonic() > deadline:
            sys.exit(f"shoal-entrypoint: the database {shown} is unreachable: {exc.orig}")
        print(f"shoal-entrypoint: waiting for the database {shown}", flush=True)
        time.sleep(2)
engine.dispose()
PY
}

join_ray() {
    : "${RAY_ADDRESS:?set RAY_ADDRESS to the Ray head (host:port)}"
    waited=0
    until ray start --address="$RAY_ADDRESS" --num-cpus=0 --disable-usage-stats >/dev/null; do
        waited=$((waited + 5))
        if [ "$waited" -ge "$WAIT_S" ]; then
            echo "shoal-entrypoint: no Ray head at $RAY_ADDRESS after ${WAIT_S} s" >&2
            exit 1
        fi
        echo "shoal-entrypoint: waiting for the Ray head at $RAY_ADDRESS"
        sleep 5
    done
}

case "${1:-control-plane}" in
control-plane)
    echo control-plane >"$ROLE_FILE"
    wait_for_database
    join_ray
    exec shoal up --ray-address auto --host "${SHOAL_HOST:-0.0.0.0}" --port "${SHOAL_PORT:-8000}"
    ;;
healthcheck)
    if [ "$(cat "$ROLE_FILE" 2>/dev/null)" = control-plane ]; then
        exec python -c "import os, urllib.request; urllib.request.urlopen(
            'http://127.0.0.1:%s/healthz' % os.environ.get('SHOAL_PORT', '8000'), timeout=4)"
    fi
    exec ray health-check --address "${RAY_ADDRESS:-127.0.0.1:6379}" --skip-version-check
    ;;
*)
    exec "$@"
    ;;
esac
