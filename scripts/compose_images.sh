#!/usr/bin/env bash
# Builds the images docker-compose.yml needs without any registry, from Debian's packages:
#
#   $BASE_TAG        Debian bookworm (minbase + python3, python3-venv) from debootstrap + `docker import`;
#                    built once and reused while the image exists (remove it to rebuild)
#   $FLEETGATE_TAG   ./Dockerfile with BASE_IMAGE=$BASE_TAG, pip installing from a wheelhouse built here
#   $REDIS_TAG       Debian's redis-server on the base image
#   $PROMETHEUS_TAG  Debian's prometheus on the base image
#
# Grafana has no Debian package, so it gets no stand-in: run the stack with `--scale grafana=0`.
# The Debian mirror is read from this machine's apt sources at run time. Prints the image variables for compose.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_TAG=${BASE_TAG:-fleetgate-base:bookworm}
FLEETGATE_TAG=${FLEETGATE_TAG:-fleetgate:dev}
REDIS_TAG=${REDIS_TAG:-fleetgate-standin-redis:bookworm}
PROMETHEUS_TAG=${PROMETHEUS_TAG:-fleetgate-standin-prometheus:bookworm}
PYTHON=${PYTHON:-python3}
log() { echo "compose_images: $*" >&2; }

mirror() {  # the first non-security Debian URI of the machine's apt sources
  local uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' /etc/apt/sources.list.d/debian.sources \
          | grep -v -- '-security' | head -n1 || true)
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; break}}' \
          /etc/apt/sources.list | grep -v -- '-security' | head -n1 || true)
  fi
  [ -n "$uri" ] || { log "no Debian mirror in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list"; exit 1; }
  echo "$uri"
}

if docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  log "$BASE_TAG exists, reused"
else
  start=$(date +%s)
  root=$(mktemp -d /var/tmp/fleetgate-rootfs.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  log "debootstrap bookworm into $root (a few minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$(mirror)" >"$root.log" 2>&1 \
    || { tail -n 20 "$root.log" >&2; exit 1; }
  rm -f "$root.log"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    -c 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null
  rm -rf "$root"
  trap - EXIT
  log "$BASE_TAG built in $(( $(date +%s) - start )) s"
fi

# The fleetgate image: dependencies come from a wheelhouse built with this machine's pip configuration, so the
# build itself needs no network and no index settings (see docs/deploy.md). async-timeout: redis needs it below
# Python 3.11.3 (Debian's python3 is 3.11.2), which the host's newer Python would not fetch; setuptools builds
# the project.
start=$(date +%s)
rm -rf .wheelhouse && mkdir -p .wheelhouse
"$PYTHON" -m pip wheel -q --wheel-dir .wheelhouse ".[docker]" "setuptools>=68" "async-timeout>=4.0.3" 2>&1 \
  | { grep -v '^WARNING: Location' || true; } >&2
rm -f .wheelhouse/fleetgate-*.whl  # the image builds the project from its sources
old=$(docker image inspect -f '{{.Id}}' "$FLEETGATE_TAG" 2>/dev/null || true)
docker build -q --build-arg BASE_IMAGE="$BASE_TAG" --build-arg WHEELHOUSE=.wheelhouse -t "$FLEETGATE_TAG" . >/dev/null
# the previous build, untagged now, goes (unless a container still runs it)
if [ -n "$old" ] && [ "$old" != "$(docker image inspect -f '{{.Id}}' "$FLEETGATE_TAG")" ]; then
  docker rmi "$old" >/dev/null 2>&1 || true
fi
log "$FLEETGATE_TAG built in $(( $(date +%s) - start )) s"

# Redis and Prometheus from Debian's packages (apt inside the build reaches the mirror on the host's network).
for svc in redis prometheus; do
  tag_var="${svc^^}_TAG"
  start=$(date +%s)
  docker build -q --network host --build-arg BASE_IMAGE="$BASE_TAG" -t "${!tag_var}" \
    -f "deploy/compose/standins/$svc.Dockerfile" deploy/compose/standins >/dev/null
  log "${!tag_var} built in $(( $(date +%s) - start )) s"
done

echo "FLEETGATE_IMAGE=$FLEETGATE_TAG"
echo "REDIS_IMAGE=$REDIS_TAG"
echo "PROMETHEUS_IMAGE=$PROMETHEUS_TAG"
# docker-compose 1.29 pulls the image of every service, even one scaled to 0: name a local image for Grafana,
# which `--scale grafana=0` never starts.
echo "GRAFANA_IMAGE=$BASE_TAG"
