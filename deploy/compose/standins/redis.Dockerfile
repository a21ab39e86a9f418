# Stand-in for the public Redis image, from Debian's redis-server (scripts/compose_images.sh builds it).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
