# One non-root image for the gateway and the simulated fleet (same image, different command).
#
# BASE_IMAGE is any Debian-like image with python3 >= 3.11 and its venv module: the default python:3.11-slim, or
# Debian's own python3 (PEP 668: no pip, packages in dist-packages). Both get a venv under /opt/fleetgate, built
# in the first stage and copied into the second, so the running image carries no build tools. The `docker`
# extra is in: the `docker` actuator of the compose profile `autoscale` needs it.
#
# WHEELHOUSE: a directory in the build context holding every dependency as a wheel (scripts/compose_images.sh
# makes .wheelhouse with `pip wheel`); pip then installs with --no-index and the build needs no network. Empty
# (the default): pip installs from the package index configured in the image.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG WHEELHOUSE=
WORKDIR /src
COPY . .
RUN python3 -m venv /opt/fleetgate \
 && if [ -n "$WHEELHOUSE" ]; then set -- --no-index --find-links "/src/$WHEELHOUSE"; fi \
 && /opt/fleetgate/bin/pip install --no-cache-dir --disable-pip-version-check "$@" "/src[docker]"

FROM ${BASE_IMAGE}
RUN useradd --create-home --uid 10001 fleetgate
COPY --from=build /opt/fleetgate /opt/fleetgate
ENV PATH=/opt/fleetgate/bin:$PATH PYTHONUNBUFFERED=1
USER fleetgate
WORKDIR /home/fleetgate
EXPOSE 8000
# The gateway's /health; compose sets the port for the simulated workers (8100).
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python3", "-c", "import sys, urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2); sys.exit(0)"]
ENTRYPOINT ["fleetgate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
