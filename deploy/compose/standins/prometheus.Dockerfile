# Stand-in for the public Prometheus image, from Debian's prometheus package (scripts/compose_images.sh builds
# it). Same entrypoint contract: arguments go to the prometheus binary.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
